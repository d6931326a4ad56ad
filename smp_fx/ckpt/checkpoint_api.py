"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``: SMP 1.10's checkpoint folders.

Layout under ``path`` (SMP's, with smp-fx's file names inside the partial folder)::

    path/
      {tag}_partial/           a partial checkpoint (one per save)
        model.pt_{mp_rank}     model.local_state_dict() of each model-parallel rank
        optimizer.pt_{mp_rank} optimizer.local_state_dict() of each model-parallel rank
        model.pt.smp_index.json, optimizer.pt.smp_index.json   (smp.save's indexes)
        user_content.pt        user_content, if given
        smp_config.json        the configuration and SMP API version it was saved with
        model_0.pt, optimizer_{r}.pt   sharded data parallelism at pp and tp 1: SMP's
                               DeepSpeed-named files, for consolidation (ckpt.ds_files)
      {tag}                    a full checkpoint: the model's full state dict (torch.save)
      user_content_{tag}       user_content of a full checkpoint
      newest                   partial checkpoints kept, oldest first, one folder a line

Crash safety of a partial save: every rank writes into a staging folder
``.{tag}_partial.incomplete``; when all ranks succeeded, world rank 0 renames it to
``{tag}_partial`` (a folder of that name from an earlier save of the same tag is first moved
to ``.{tag}_partial.replaced``, which a resume uses if a crash came between the two
renames), then rewrites ``newest`` atomically, and only then deletes the checkpoints that
``num_kept_partial_checkpoints`` rotates out. So ``newest`` names a complete checkpoint at
every instant: a process killed anywhere leaves the previous checkpoint loadable, and at
worst a staging folder or a rotated-out folder behind. Full checkpoints are single files
written atomically (``smp_fx.ckpt.atomic``).

Every rank calls both functions (they are collective over the world); which ranks write
what follows SMP: model and optimizer files from the data-parallel rank 0 replica, shared
files from world rank 0. Loads are deferred until the model is partitioned, as
``load_state_dict`` is; a resume before the ``DistributedModel`` or the
``DistributedOptimizer`` exists applies when they are created.

Where SMP's page and SMP's behaviour differ, and what smp-fx follows: ``docs/checkpoints.md``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt import async_save as background
from smp_fx.ckpt import ds_files
from smp_fx.ckpt.atomic import atomic_write, fsync_dir
from smp_fx.ckpt.commit import index_entry, index_writer, prepare_partial, torch_writer
from smp_fx.ckpt.files import load_at, save_at
from smp_fx.ckpt.hf_export import is_pretrained, safetensors_available, save_pretrained_state
from smp_fx.ckpt.hf_weights import find_hf_weights, read_hf_weights
from smp_fx.ckpt.layout import index_path
from smp_fx.ckpt.ranks import RankInfo, current_rank
from smp_fx.ckpt.safe_load import read_file
from smp_fx.ckpt.snapshot import Snapshot
from smp_fx.ckpt.validate import agree_or_raise, raise_failures, said
from smp_fx.ckpt.view import Ranks, ViewedModel
from smp_fx.version import SMP_API_VERSION
from smp_fx.world import context
from smp_fx.world.context import ProcessOptimizer
from smp_fx.world.state_api import module_manager

log = logging.getLogger(__name__)

NEWEST = "newest"
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
USER_CONTENT_FILE = "user_content.pt"
CONFIG_FILE = "smp_config.json"
PARTIAL_KEY = "_smp_is_partial"

Translate = Callable[[dict[str, Any]], dict[str, Any]]

_snapshot = Snapshot()  # the host copies of asynchronous saves, reused


def partial_dir(tag: str) -> str:
    """The folder name of a partial checkpoint (SMP's: the tag and ``_partial``)."""
    return f"{tag}_partial"


def staging_dir(name: str) -> str:
    return f".{name}.incomplete"


def _replaced(name: str) -> str:
    return f".{name}.replaced"


# ---------------------------------------------------------------- where this rank is


def _tag_ok(tag: Any) -> bool:
    return isinstance(tag, str) and tag not in ("", ".", "..") and os.sep not in tag


def _check_tag(tag: Any, ranks: Ranks) -> str:
    ok = _tag_ok(tag)
    gather = ranks.world_gather()
    tags = [tag if ok else None] if gather is None else gather(tag if ok else None)
    _same_tags(tags)
    return str(tag)


def _same_tags(tags: list[Any]) -> None:
    """Raise unless every rank's tag (None: not a valid one) is the same valid one."""
    if tags[0] is None or any(t != tags[0] for t in tags):
        raise SMPCheckpointError.build(
            "a checkpoint tag must be the same non-empty file name (str) on every rank",
            tags, where="smp.save_checkpoint / smp.resume_from_checkpoint",
            fix="pass e.g. tag=f'step{step}', computed alike on every rank")


# ---------------------------------------------------------------------------- save


def save_checkpoint(path: str, tag: str, partial: bool = True,
                    model: ViewedModel | None = None,
                    optimizer: ProcessOptimizer | None = None, user_content: Any = None,
                    translate_if_full: bool = True,
                    num_kept_partial_checkpoints: int | None = None,
                    async_save: bool | None = None) -> None:
    """Save a checkpoint of ``model`` and ``optimizer`` under ``path`` (see the module doc).

    ``partial=True`` saves each model-parallel rank's own parameters and optimizer state
    (the format to resume training from, at this or another pipeline degree) and records it
    in ``newest``, keeping at most ``num_kept_partial_checkpoints`` of them (None: all).
    ``partial=False`` saves the full model state dict as one file named ``tag``, translated
    to Hugging Face names by ``smp.state.module_manager.translate_functions`` when
    ``translate_if_full``; an optimizer is not saved in a full checkpoint (as in SMP: a
    warning says so). A model that wraps a Hugging Face ``PreTrainedModel`` is also written
    into ``path`` as its ``save_pretrained`` writes it (configuration and safetensors
    weights: ``from_pretrained(path)`` loads it; ``smp_fx.ckpt.hf_export``). Collective:
    call it on every rank.

    ``async_save=True`` (an smp-fx extension; None: the configuration's
    ``async_checkpoint``) copies the state off the training tensors and returns; a
    background thread writes it while training goes on, and it is committed once every
    rank's part is written (``smp_fx.ckpt.async_save``; ``smp.wait_checkpoint()`` waits).

    Example::

        smp.save_checkpoint("/ckpt", tag=f"total_steps{step}", partial=True, model=model,
                            optimizer=optimizer, user_content={"step": step},
                            num_kept_partial_checkpoints=2)
    """
    ranks = Ranks.current()
    if async_save is None:
        async_save = ranks.config is not None and ranks.config.async_checkpoint
    if not (async_save and partial):  # an asynchronous partial save compares tags later
        tag = _check_tag(tag, ranks)
    if num_kept_partial_checkpoints is not None and (
            isinstance(num_kept_partial_checkpoints, bool)
            or not isinstance(num_kept_partial_checkpoints, int)
            or num_kept_partial_checkpoints < 1):
        raise SMPCheckpointError.build(
            "num_kept_partial_checkpoints must be None or an int >= 1",
            num_kept_partial_checkpoints, where="smp.save_checkpoint",
            fix="pass None to keep every partial checkpoint")
    if model is None and optimizer is None:
        log.warning("smp.save_checkpoint: model and optimizer are both None; saving only "
                    "user_content")
    background.settle(block=True, next_tag=tag)  # one save in flight at most
    if async_save:
        _save_async(path, tag, partial, model, optimizer, user_content, translate_if_full,
                    num_kept_partial_checkpoints, ranks)
        return
    if partial:
        _save_partial(path, tag, model, optimizer, user_content,
                      num_kept_partial_checkpoints, ranks)
    else:
        _save_full(path, tag, model, optimizer, user_content, translate_if_full, ranks)


def _save_partial(path: str, tag: str, model: ViewedModel | None,
                  optimizer: ProcessOptimizer | None, user_content: Any,
                  num_kept: int | None, ranks: Ranks) -> None:
    name = partial_dir(tag)
    staging = make_staging(path, name, ranks)
    model_sd, opt_sd = local_states(model, optimizer, ranks)
    cause: BaseException | None = None
    try:
        if model_sd is not None:  # collective over this replica's model-parallel group
            save_at(ranks, model_sd, os.path.join(staging, MODEL_FILE), partial=True)
        if opt_sd is not None:
            save_at(ranks, opt_sd, os.path.join(staging, OPTIMIZER_FILE), partial=True)
        ds_files.write(staging, model, optimizer, model_sd, ranks)  # SMP's sdp files beside
        user_content = ds_files.with_shapes(user_content, model, optimizer, ranks)
        if ranks.rank == 0:
            if user_content is not None:
                write_torch(os.path.join(staging, USER_CONTENT_FILE), user_content)
            write_json(os.path.join(staging, CONFIG_FILE), config_record(ranks))
    except Exception as exc:
        cause = exc
    agree_or_raise(cause, f"writing the partial checkpoint {name}", ranks)
    if ranks.rank == 0:
        try:
            commit(path, name, num_kept)
        except OSError as exc:
            cause = exc
    agree_or_raise(cause, f"committing the partial checkpoint {name}", ranks)


def make_staging(path: str, name: str, ranks: Ranks) -> str:
    """World rank 0 creates the empty staging folder of the partial checkpoint ``name``
    (removing one a killed save left); every rank learns whether it could."""
    staging = os.path.join(path, staging_dir(name))
    cause: BaseException | None = None
    if ranks.rank == 0:
        try:
            _fresh_folder(path, staging)
        except OSError as exc:
            cause = exc
    agree_or_raise(cause, f"creating {staging}", ranks)
    return staging


def _fresh_folder(path: str, staging: str) -> None:
    os.makedirs(path, exist_ok=True)
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed save
    os.makedirs(staging)


def local_states(model: ViewedModel | None, optimizer: ProcessOptimizer | None,
                 ranks: Ranks) -> tuple[Any, Any]:
    """The local model and optimizer state dicts a partial save writes (None where this
    rank writes none); every rank calls it, and a failure on one is raised on all."""
    model_sd, opt_sd, cause = _collect_states(model, optimizer, ranks)
    agree_or_raise(cause, "collecting the local state dicts", ranks)
    return model_sd, opt_sd


def _collect_states(model: ViewedModel | None, optimizer: ProcessOptimizer | None,
                    ranks: Ranks) -> tuple[Any, Any, BaseException | None]:
    """``local_states`` without the agreement: the state dicts, or why they failed here."""
    cause: BaseException | None = None
    model_sd = opt_sd = None
    rdp_rank = _rdp_rank(ranks)
    try:  # everything that can fail on one rank, before any collective of a subgroup
        # sharded data parallelism gathers whole tensors over the shard group, a sharded
        # optimizer state its stage's shards: then every dp rank takes part
        everyone = _every_rank(model)
        model_sd = (model.local_state_dict()
                    if model is not None and (rdp_rank == 0 or everyone) else None)
        model_sd = model_sd if rdp_rank == 0 else None
        sharded = bool(getattr(optimizer, "shards_state", False)) or everyone
        opt_sd = (optimizer.local_state_dict()
                  if optimizer is not None and (rdp_rank == 0 or sharded) else None)
        opt_sd = opt_sd if rdp_rank == 0 else None
    except Exception as exc:
        cause = exc
    return model_sd, opt_sd, cause


def _every_rank(model: ViewedModel | None) -> bool:
    """Whether every data-parallel rank takes part in the model's state: sharded data
    parallelism gathers its shards, expert parallelism its experts."""
    if model is None:
        return False
    view = model.checkpoint_view()
    return view.shards_parameters or bool(view.experts)


def commit(path: str, name: str, num_kept: int | None) -> None:
    """Rank 0: staging folder -> ``name``, then ``newest``, then rotation (module doc)."""
    final = os.path.join(path, name)
    replaced = os.path.join(path, _replaced(name))
    if os.path.exists(final):
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(os.path.join(path, staging_dir(name)), final)
    fsync_dir(path)
    history = [n for n in read_newest(path) if n != name] + [name]
    rotated: list[str] = []
    if num_kept is not None:
        rotated, history = history[:-num_kept], history[-num_kept:]
    text = "".join(f"{n}\n" for n in history).encode()
    atomic_write(os.path.join(path, NEWEST), lambda fh: fh.write(text))
    for old in [*rotated, _replaced(name)]:
        shutil.rmtree(os.path.join(path, old), ignore_errors=True)


def _save_full(path: str, tag: str, model: ViewedModel | None,
               optimizer: ProcessOptimizer | None, user_content: Any,
               translate: bool, ranks: Ranks) -> None:
    if optimizer is not None:
        log.warning("smp.save_checkpoint(partial=False) saves the model only; the optimizer "
                    "state is saved by partial checkpoints (as in SMP)")
    cause: BaseException | None = None
    try:
        sd = full_state(model, _rdp_rank(ranks))
        if ranks.rank == 0:
            for write in full_writes(path, tag, model, sd, user_content, translate):
                write()
    except Exception as exc:
        cause = exc
    agree_or_raise(cause, f"writing the full checkpoint {tag}", ranks)


def full_state(model: ViewedModel | None, rdp_rank: int) -> dict[str, Any] | None:
    """The full model state dict a full save writes, on the ranks with rdp rank 0 (a
    collective over the pipeline group, over the shards under sdp, over the experts at ep)."""
    if model is None or not (rdp_rank == 0 or _every_rank(model)):
        return None
    sd = dict(model.state_dict())
    return sd if rdp_rank == 0 else None


def full_writes(path: str, tag: str, model: ViewedModel | None, sd: dict[str, Any] | None,
                user_content: Any, translate: bool) -> list[Callable[[], None]]:
    """World rank 0's writes of a full checkpoint of ``sd``, each an atomic file (or
    ``save_pretrained``'s set), in order; no collective."""
    os.makedirs(path, exist_ok=True)
    writes: list[Callable[[], None]] = []
    hf_module = _pretrained_module(model)
    if sd is not None and model is not None and hf_module is not None:
        if safetensors_available():  # what from_pretrained(path) loads
            hf_sd = sd if hf_module is model.get_module() else _to_hf(dict(sd))
            writes.append(lambda: save_pretrained_state(path, hf_sd, hf_module))
        else:  # transformers 4.2x does not install it; SMP's own file is still written
            log.warning("smp.save_checkpoint(partial=False): no safetensors package, "
                        "so %s gets no save_pretrained weights (pip install "
                        "safetensors)", path)
    if sd is not None:
        if translate:
            sd = _to_hf(sd)
        else:
            sd[PARTIAL_KEY] = False  # marks smp-format names: never translated back
        writes.append(functools.partial(write_torch, os.path.join(path, tag), sd))
    if user_content is not None:
        writes.append(functools.partial(write_torch, os.path.join(path, f"user_content_{tag}"),
                                        user_content))
    return writes


def _save_async(path: str, tag: str, partial: bool, model: ViewedModel | None,
                optimizer: ProcessOptimizer | None, user_content: Any, translate: bool,
                num_kept: int | None, ranks: Ranks) -> None:
    """``async_save=True``: what communicates or reads live state now, the writes by the
    background writer (``smp_fx.ckpt.async_save``)."""
    if partial:
        name, writes = _partial_writes(path, tag, model, optimizer, user_content, ranks)
        background.start(name, os.path.join(path, staging_dir(name)), ranks, writes,
                         functools.partial(commit, path, name, num_kept), _snapshot.ready)
    else:
        writes = _full_writes(path, tag, model, optimizer, user_content, translate, ranks)
        background.start(tag, None, ranks, writes, lambda: None, _snapshot.ready)


def _partial_writes(path: str, tag: str, model: ViewedModel | None,
                    optimizer: ProcessOptimizer | None, user_content: Any,
                    ranks: Ranks) -> tuple[str, list[Callable[[], None]]]:
    """Everything of a partial save that communicates or reads live state, done now in one
    world gather (``one_gather``); the partial folder's name and the files' writes
    returned for the writer thread."""
    ok = _tag_ok(tag)
    name = partial_dir(tag if ok else "invalid")
    staging = os.path.join(path, staging_dir(name))
    cause: BaseException | None = None
    if ok and ranks.rank == 0:
        try:
            _fresh_folder(path, staging)
        except OSError as exc:
            cause = exc
    model_sd, opt_sd, failed = _collect_states(model, optimizer, ranks)
    cause = cause or failed
    if ds_files.applies(model, optimizer, ranks):  # gathers over the shard groups next
        agree_or_raise(cause, "collecting the local state dicts", ranks)
    mine: dict[str, Any] = {}
    info = RankInfo()
    sds: list[tuple[Any, str]] = []
    ds: list[tuple[str, Any]] = []
    user = None
    if cause is None:
        try:
            ds = ds_files.files(staging, model, optimizer, model_sd, ranks)  # sdp: everyone
            user = (ds_files.with_shapes(user_content, model, optimizer, ranks)
                    if ranks.rank == 0 else None)
            model_sd, opt_sd, ds, user = _snapshot.take((model_sd, opt_sd, ds, user),
                                                        _stepped(model, optimizer))
            info, _ = current_rank(ranks)
            sds = [(sd, file) for sd, file in ((model_sd, MODEL_FILE),
                                               (opt_sd, OPTIMIZER_FILE)) if sd is not None]
            mine = {file: index_entry(sd, os.path.join(staging, file), info)
                    for sd, file in sds}
        except Exception as exc:
            cause = exc
    outcomes = one_gather((tag if ok else None, said(cause), mine), ranks)
    try:
        _same_tags([o[0] for o in outcomes])
        raise_failures([o[1] for o in outcomes], cause,
                       f"preparing the asynchronous checkpoint {name}")
    except BaseException:
        _snapshot.drop()  # no writer will take the copies
        if ok and ranks.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    group = [0] if ranks.alone else ranks.group_ranks("mp")
    write = background.write
    writes: list[Callable[[], None]] = []
    for sd, file in sds:
        f = os.path.join(staging, file)
        entries = [outcomes[r][2][file] for r in group]
        target, wrapped, index = prepare_partial(sd, f, info,
                                                 functools.partial(_gathered, entries))
        writes.append(functools.partial(write, target, torch_writer(wrapped, pickle, 2)))
        if info.mp_rank == 0:
            writes.append(functools.partial(write, index_path(f), index_writer(index)))
    for file, obj in ds:
        writes.append(functools.partial(write, file, torch_writer(obj, pickle, 2)))
    if ranks.rank == 0:
        if user is not None:
            writes.append(functools.partial(
                write, os.path.join(staging, USER_CONTENT_FILE), torch_writer(user, pickle, 2)))
        writes.append(functools.partial(write_json, os.path.join(staging, CONFIG_FILE),
                                        config_record(ranks)))
    return name, writes


def _gathered(entries: list[Any], _: Any) -> list[Any]:
    return entries


def one_gather(mine: Any, ranks: Ranks) -> list[Any]:
    """The asynchronous save call's single world gather: each rank's tag, failure and
    index entries, where a synchronous save gathers each in turn (the tag, the staging
    folder, the state dicts, each file's index, the outcome). The call at pp 2 x dp 2
    (``benchmarks/async_checkpoint.py``): 0.052 s with five gathers, 0.015-0.020 s with
    one."""
    gather = ranks.world_gather()
    return [mine] if gather is None else gather(mine)


def _stepped(model: ViewedModel | None, optimizer: ProcessOptimizer | None) -> set[int]:
    """The storages only an optimizer step or a load changes (``Snapshot.defer``): the
    model's parameters and the optimizer's state; buffers (changed by forward) are not."""
    held: list[torch.Tensor] = [] if model is None else list(model.get_module().parameters())
    torch_optimizer = getattr(optimizer, "torch_optimizer", None)
    if torch_optimizer is not None:
        held += [v for s in torch_optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in held}


def _full_writes(path: str, tag: str, model: ViewedModel | None,
                 optimizer: ProcessOptimizer | None, user_content: Any, translate: bool,
                 ranks: Ranks) -> list[Callable[[], None]]:
    if optimizer is not None:
        log.warning("smp.save_checkpoint(partial=False) saves the model only; the optimizer "
                    "state is saved by partial checkpoints (as in SMP)")
    cause: BaseException | None = None
    writes: list[Callable[[], None]] = []
    try:
        sd = full_state(model, _rdp_rank(ranks))
        if ranks.rank == 0:
            sd, user = _snapshot.take((sd, user_content))
            writes = full_writes(path, tag, model, sd, user, translate)
    except Exception as exc:
        cause = exc
    agree_or_raise(cause, f"preparing the asynchronous full checkpoint {tag}", ranks)
    return writes


def _rdp_rank(ranks: Ranks) -> int:
    """Which replica this rank is in (0: the one whose ranks write; a cp rank other than 0
    counts as 1: its state is cp rank 0's); 0 alone."""
    if ranks.alone:
        return 0
    return ranks.axis_rank("rdp") if ranks.cp_writer else 1


def _pretrained_module(model: ViewedModel | None) -> nn.Module | None:
    """The Hugging Face model whose ``save_pretrained`` writes a full checkpoint's weights:
    the wrapped module, or, where SMP replaced a Hugging Face model by its distributed
    version (``smp_fx.nn.huggingface``), the model the script built, whose names the
    translate functions give back."""
    if model is None:
        return None
    for module in (model.get_module(), model.script_module()):
        if module is not None and is_pretrained(module):
            return module
    return None


def _to_hf(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` in Hugging Face's names (``smp.state.module_manager``'s smp_to_hf)."""
    for smp_to_hf, _ in module_manager.translate_functions:
        state = smp_to_hf(state)
    return state


def write_torch(path: str, obj: Any) -> None:
    atomic_write(path, lambda fh: torch.save(obj, fh))


def write_json(path: str, obj: Any) -> None:
    text = json.dumps(obj, indent=1, sort_keys=True).encode()
    atomic_write(path, lambda fh: fh.write(text))


def config_record(ranks: Ranks) -> dict[str, Any]:
    record: dict[str, Any] = {"smp_version": SMP_API_VERSION}
    if ranks.config is not None:
        record["config"] = ranks.config.values()
    return record


def read_newest(path: str) -> list[str]:
    """The partial checkpoint folders listed in ``path/newest``, oldest first."""
    try:
        with open(os.path.join(path, NEWEST), encoding="utf-8") as fh:
            return [line.strip() for line in fh if line.strip()]
    except FileNotFoundError:
        return []


# -------------------------------------------------------------------------- resume


_pending: dict[str, Any] = {}
"""Loads asked for before their DistributedModel / DistributedOptimizer existed."""


def resume_from_checkpoint(path: str, tag: str | None = None, partial: bool = True,
                           strict: bool = True, load_optimizer: bool = True,
                           load_sharded_optimizer_state: bool = True,
                           translate_function: Translate | None = None) -> Any:
    """Resume from a checkpoint of ``save_checkpoint``; returns its ``user_content`` (or None).

    ``tag=None`` (partial only) takes the newest partial checkpoint. A partial checkpoint
    loads at the saved pipeline degree or another one (state is matched by parameter
    name). ``partial=False`` loads the full file ``path/tag``; its names are translated
    by ``translate_function``, else by ``smp.state.module_manager.translate_functions``
    (hf_to_smp) unless it was saved untranslated. When ``path/tag`` does not exist but
    ``path`` holds the weights ``save_pretrained`` writes (``model.safetensors``, sharded
    or not), those are loaded: the Hugging Face Trainer asks for ``pytorch_model.bin``
    while transformers 5 writes only safetensors (a warning names the file used). Full
    checkpoints hold no optimizer state (SMP's behaviour; a warning says so if
    ``load_optimizer``). ``load_sharded_optimizer_state`` concerns sharded data
    parallelism, whose checkpoints smp-fx does not build; it is accepted and has no effect
    (an optimizer-state-sharded checkpoint holds each stage's merged state, which loads at
    any dp size). The loads
    apply when the model is partitioned. Collective: call it on every rank.

    Example::

        user_content = smp.resume_from_checkpoint("/ckpt", partial=True)
    """
    ranks = Ranks.current()
    background.settle(block=True)  # a save in flight is committed (or raised) first
    if partial:
        folder = _partial_folder(path, tag, ranks)
        user = _read_optional(os.path.join(folder, USER_CONTENT_FILE))
        model_state = _read_partial(folder, MODEL_FILE, context.current_model(), ranks)
        opt_state = None
        if load_optimizer:
            opt_state = _read_partial(folder, OPTIMIZER_FILE, context.current_optimizer(),
                                      ranks)
        _apply_model(model_state, strict)
        if opt_state is not None:
            _apply_optimizer(opt_state)
        return user
    if tag is None:
        raise SMPCheckpointError.build("tag is required to load a full checkpoint", None,
                                       where="smp.resume_from_checkpoint(partial=False)",
                                       fix="pass the tag (the file name) it was saved with")
    tag = _check_tag(tag, ranks)
    state = _read_full(path, tag)
    if state.pop(PARTIAL_KEY, None) is not False:  # not saved untranslated by smp
        if translate_function is not None:
            state = translate_function(state)
        else:
            for _, hf_to_smp in module_manager.translate_functions:
                state = hf_to_smp(state)
    if load_optimizer:
        log.warning("smp.resume_from_checkpoint(partial=False): a full checkpoint holds no "
                    "optimizer state; only the model is loaded (as in SMP)")
    _apply_model(state, strict)
    return _read_optional(os.path.join(path, f"user_content_{tag}"))


def _partial_folder(path: str, tag: str | None, ranks: Ranks) -> str:
    if tag is None:
        listed = read_newest(path)
        if not listed:
            raise SMPCheckpointError.build(
                "no partial checkpoint is listed in the newest file", os.path.join(path, NEWEST),
                fix="pass tag=..., or save with smp.save_checkpoint(partial=True) first")
        name = listed[-1]
    else:
        name = partial_dir(_check_tag(tag, ranks))
    folder = os.path.join(path, name)
    if not os.path.isdir(folder):
        interrupted = os.path.join(path, _replaced(name))
        if os.path.isdir(interrupted):
            log.warning("%s is missing: a save of the same tag was interrupted between its "
                        "renames; loading the checkpoint it replaced, %s", folder, interrupted)
            return interrupted
        raise SMPCheckpointError.build("checkpoint folder does not exist", folder,
                                       fix="check path and tag (the newest file lists them)")
    return folder


def _read_optional(file: str) -> Any:
    return read_file(file) if os.path.exists(file) else None


def _read_partial(folder: str, file: str, target: Any, ranks: Ranks) -> Any:
    """This rank's part of ``file`` (None when the checkpoint has none and nothing exists
    to load it into; an error when ``target``, a model or optimizer, would go without)."""
    prefix = os.path.join(folder, file)
    if os.path.exists(f"{prefix}.smp_index.json"):
        return load_at(ranks, prefix, partial=True)
    if target is not None:
        raise SMPCheckpointError.build(
            "the checkpoint holds no state for the " + type(target).__name__, prefix,
            fix="save it with that object given, or pass load_optimizer=False")
    return None


def _read_full(path: str, tag: str) -> dict[str, Any]:
    file = os.path.join(path, tag)
    if os.path.exists(file):
        if file.endswith(".safetensors"):
            return read_hf_weights([file])
        state = read_file(file)
        if not isinstance(state, dict):
            raise SMPCheckpointError.build("a full checkpoint must hold a state dict",
                                           type(state).__name__, where=file,
                                           fix="load it with smp.load(partial=False)")
        return dict(state)
    found = find_hf_weights(path)
    if not found:
        raise SMPCheckpointError.build(
            "full checkpoint file does not exist", file,
            fix="check path and tag (a full checkpoint is the file path/tag)")
    log.warning("%s does not exist; loading the Hugging Face weights in %s (%s), which "
                "save_pretrained wrote", file, path, ", ".join(map(os.path.basename, found)))
    return read_hf_weights(found)


def _apply_model(state: Any, strict: bool) -> None:
    if state is None:
        return
    model = context.current_model()
    if model is None:
        _pending["model"] = (state, strict)
        return
    model.load_state_dict(state, strict=strict)


def _apply_optimizer(state: Any) -> None:
    optimizer = context.current_optimizer()
    if optimizer is None or not _belongs(optimizer):
        _pending["optimizer"] = state
        return
    optimizer.load_state_dict(state)


def _belongs(optimizer: ProcessOptimizer) -> bool:
    """Whether ``optimizer`` belongs to the current DistributedModel (not still waiting)."""
    return optimizer not in context.waiting_optimizers()


def adopt_pending(model: ViewedModel | None = None,
                  optimizer: ProcessOptimizer | None = None) -> None:
    """Apply a resume that came before ``model`` / ``optimizer`` existed (called by the
    DistributedModel when it is created and by a DistributedOptimizer joining a model)."""
    if model is not None and "model" in _pending:
        state, strict = _pending.pop("model")
        model.load_state_dict(state, strict=strict)
    if optimizer is not None and "optimizer" in _pending:
        optimizer.load_state_dict(_pending.pop("optimizer"))


def forget_pending() -> None:
    """``smp.reset()``: drop resumes still waiting for their model or optimizer."""
    _pending.clear()

