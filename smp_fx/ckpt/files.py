"""``smp.save`` / ``smp.load``: the entry points, and reading a partial set (resharding).

A full checkpoint (``partial=False``) is one plain ``torch.save`` file; a partial one is a
file per model-parallel rank plus an index. The pieces live beside this module, one concept
each, so the entry points read as the steps they take:

* ``smp_fx.ckpt.layout``: the file names, the format markers and the index;
* ``smp_fx.ckpt.commit``: the crash-safe commit protocol of a partial save;
* ``smp_fx.ckpt.safe_load``: reading one file (the safe loader unless told otherwise);
* ``smp_fx.ckpt.ranks``: which file this rank writes, at which degrees.

What stays here: a partial checkpoint read at the degrees it was saved with (each mp rank
its own file, or an index-less set of SMP's own), or at others, when every file is read and
the state dicts are merged by name.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt import tp_shards
from smp_fx.ckpt.atomic import atomic_write
from smp_fx.ckpt.commit import save_partial, torch_writer
from smp_fx.ckpt.layout import (
    WRAP_KEY,
    index_path,
    partial_path,
    prev_path,
    read_index,
    replica_path,
    replicas,
    unwrap,
)
from smp_fx.ckpt.ranks import RankInfo, current_rank
from smp_fx.ckpt.safe_load import read_file
from smp_fx.ckpt.state_dict import (
    GROUP_PARAMS_KEY,
    PARTIAL_KEY,
    merge_model_state_dicts,
    merge_optimizer_state_dicts,
    merge_partial_optimizer_states,
)
from smp_fx.ckpt.validate import agreed
from smp_fx.ckpt.view import Ranks

log = logging.getLogger(__name__)


def save(obj: Any, f: str, partial: bool = True, pickle_module: Any = pickle,
         pickle_protocol: int = 2, v3: bool = False) -> None:
    """Save ``obj`` as SMP does: per model-parallel rank files when ``partial``.

    Call it on the ranks with ``smp.dp_rank() == 0`` (every mp rank of that group when
    ``partial=True``: it is collective over the model-parallel group). With
    ``partial=False`` only mp rank 0 writes ``f``; other ranks return at once. At
    ``context_parallel_degree`` > 1 the cp ranks of a replica hold the same state: cp rank 0
    writes, the others return at once.
    ``v3=True`` (SMP 1.10's per-rank format, which the Hugging Face Trainer asks for with
    ``v3=smp.state.cfg.shard_optimizer_state``): every data-parallel replica saves its own
    partial checkpoint (``smp_fx.ckpt.layout.replica_path``), so each rank's shard of a
    sharded optimizer state is kept; call it on every rank. ``smp.load(f, partial=True)``
    reads such a set back, merging the replicas' shards.

    Example::

        smp.save({"model_state_dict": model.local_state_dict(),
                  "optimizer_state_dict": optimizer.local_state_dict()},
                 "/ckpt/checkpoint.pt", partial=True)
    """
    save_at(Ranks.current(), obj, f, partial, pickle_module, pickle_protocol, v3)


def save_at(ranks: Ranks, obj: Any, f: str, partial: bool = True, pickle_module: Any = pickle,
            pickle_protocol: int = 2, v3: bool = False) -> None:
    """``save`` as the process at ``ranks``."""
    f = _check_path(f)
    if not ranks.cp_writer:  # its objects are cp rank 0's, which writes them
        return
    if v3 and not partial:
        raise SMPCheckpointError.build(
            "smp.save(..., v3=True) writes per-rank partial files", "partial=False",
            f, "pass partial=True with v3=True, or v3=False for a full checkpoint")
    if partial:
        info, gather = current_rank(ranks)
        if v3:
            f = replica_path(f, ranks.axis_rank("rdp"))
        save_partial(obj, f, info, gather, pickle_module, pickle_protocol)
        return
    if ranks.axis_rank("mp") != 0:
        return
    atomic_write(f, torch_writer(obj, pickle_module, pickle_protocol))


def _check_path(f: Any) -> str:
    if isinstance(f, os.PathLike):
        f = os.fspath(f)
    if not isinstance(f, str):
        raise SMPCheckpointError.build(
            "smp.save/smp.load take a file name (str), not a file object", type(f).__name__,
            fix="pass a path; per-rank files are derived from it")
    return f


# ------------------------------------------------------------------------- load


def read_partial_file(f: str, entry: Mapping[str, Any], save_id: str,
                      **load_kw: Any) -> Any:
    """The object one mp rank saved under the committed ``save_id`` (its ``.prev`` twin
    when a later save was interrupted before its index was written)."""
    path = os.path.join(os.path.dirname(os.path.abspath(f)), entry["file"])
    candidates = [c for c in (path, prev_path(path)) if os.path.exists(c)]
    if not candidates:
        raise SMPCheckpointError.build(
            f"the file of model-parallel rank {entry['mp_rank']} of this partial checkpoint "
            "is missing", path, where=index_path(f),
            fix="copy every file of a checkpoint together (NAME_0 ... NAME_<n-1> and "
            "NAME.smp_index.json), or load another checkpoint")
    for candidate in candidates:
        data = read_file(candidate, **load_kw)
        if isinstance(data, Mapping) and data.get("save_id") == save_id:
            if candidate != path:
                log.warning("%s belongs to an interrupted save; loading %s, the file of "
                            "the committed checkpoint %s", path, candidate, save_id)
            return data["object"]
    raise SMPCheckpointError.build(
        "no file of this partial checkpoint matches its index (save id)", save_id,
        where=path, fix="the files come from different saves (copied apart, or the set was "
        "changed outside smp.save); restore the set or load another checkpoint")


def merge_partial_objects(objs: Sequence[Any], full: bool = False) -> Any:
    """Merge the objects of several partial files by name.

    Partial model and optimizer state dicts (``_smp_is_partial``) found at the top level are
    merged; other values come from the first object (mp rank 0). With ``full`` the result
    is a full checkpoint (plain torch formats, no smp keys); otherwise it stays partial so a
    DistributedModel / DistributedOptimizer picks its parameters by name.
    """
    def merge(values: list[Any]) -> Any:
        if not (isinstance(values[0], Mapping) and values[0].get(PARTIAL_KEY)):
            return values[0]
        values = tp_shards.join(values)  # shards of every tp rank -> full tensors
        if GROUP_PARAMS_KEY in values[0]:
            return (merge_optimizer_state_dicts(values) if full
                    else merge_partial_optimizer_states(values))
        merged = merge_model_state_dicts(values)
        if not full:
            merged[PARTIAL_KEY] = True
        return merged

    first = objs[0]
    if isinstance(first, Mapping) and first.get(PARTIAL_KEY):
        return merge(list(objs))
    if not isinstance(first, Mapping):
        return first
    return {key: merge([o[key] for o in objs if isinstance(o, Mapping) and key in o])
            for key in first}


def _load_unindexed(f: str, info: RankInfo, load_kw: dict[str, Any]) -> Any:
    """This rank's file of a partial checkpoint without an index (SMP's own, or one whose
    index was lost): only at the degrees it was saved with, which the files must show."""
    path = partial_path(f, info.mp_rank)
    if not os.path.exists(path):
        if os.path.exists(f):
            fix = "pass partial=False to load a full checkpoint saved with partial=False"
        else:
            fix = (f"this job has {info.num_files} model-parallel rank(s); the checkpoint "
                   "was saved with fewer, or its files were not all copied")
        raise SMPCheckpointError.build("partial checkpoint file not found", path,
                                       where=f"mp_rank {info.mp_rank}", fix=fix)
    if os.path.exists(partial_path(f, info.num_files)):
        raise SMPCheckpointError.build(
            "the partial checkpoint has more files than this job has model-parallel ranks",
            partial_path(f, info.num_files), where=f"{f} (no index)",
            fix=f"load it at the degrees it was saved with, or save it with smp-fx, whose "
            f"index allows loading at another pipeline degree ({index_path(f)})")
    data = read_file(path, **load_kw)
    if isinstance(data, Mapping) and WRAP_KEY in data and data.get("mp_rank") != info.mp_rank:
        raise SMPCheckpointError.build(
            "the partial file belongs to another model-parallel rank",
            f"saved by mp_rank {data.get('mp_rank')}", path,
            "files were renamed or copied over each other; restore the set")
    return unwrap(data)


def load_partial_set(f: str, **load_kw: Any) -> tuple[dict[str, Any], list[Any]]:
    """The index and the object of every file of the partial checkpoint ``f``."""
    index = read_index(f)
    if index is None:
        raise SMPCheckpointError.build(
            "partial checkpoint has no index file", index_path(f),
            fix="save with smp.save(..., partial=True) of smp-fx, or load one file with "
            "smp.load(f, partial=True) on each mp rank")
    objs = [read_partial_file(f, e, index["save_id"], **load_kw) for e in index["files"]]
    return index, objs


def load(f: str, map_location: Any = None, pickle_module: Any = pickle, partial: bool = True,
         weights_only: bool | None = None, back_compat: bool = False,
         **pickle_load_args: Any) -> Any:
    """Load what ``smp.save`` wrote; with ``partial`` each mp rank reads its own file.

    When the partial checkpoint was saved at another pipeline degree or chunk placement
    (``virtual_pipeline_degree``; its index says so), every file is read and the state
    dicts are merged by name (resharding); the model and optimizer then take their own
    parameters. A per-rank (``v3=True``) save is read as the merge of its replicas' files
    for this rank: a sharded optimizer state comes back whole for the stage, and each rank
    keeps what it owns at whatever data-parallel size.

    ``back_compat=True`` is how the Hugging Face Trainer asks SMP 1.10+ to read an optimizer
    state saved by SMP before 1.10; smp-fx has one file format, so it reads it as any.

    Safety: by default only tensors, containers, numbers, strings, optimizer and
    LR-scheduler state and numpy values load (``torch.load(weights_only=True)``).
    ``weights_only=False`` allows arbitrary pickled objects; so does passing a
    ``pickle_module`` other than ``pickle`` (as SMP's page documents it), since that module
    is used to unpickle: both only for files you trust.

    Collective, as SMP says ("load on all ranks"): every rank reads its part, then the
    ranks agree, so a file that fails on one rank is an ``SMPCheckpointError`` on every rank
    instead of a hang in the next collective (``validate.agreed``).

    Example::

        ckpt = smp.load("/ckpt/checkpoint.pt", partial=True)
        model.load_state_dict(ckpt["model_state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_state_dict"])
    """
    del back_compat  # one format (see the docstring)
    return load_at(Ranks.current(), f, partial, map_location=map_location,
                   pickle_module=pickle_module, weights_only=weights_only, **pickle_load_args)


def load_at(ranks: Ranks, f: str, partial: bool = True, **load_kw: Any) -> Any:
    """``load`` as the process at ``ranks`` (``load_kw``: ``torch.load``'s)."""
    f = _check_path(f)
    return agreed(f"smp.load({f!r})", lambda: _load(f, partial, load_kw, ranks), ranks)


def _load(f: str, partial: bool, load_kw: dict[str, Any], ranks: Ranks) -> Any:
    """This rank's part of ``load``."""
    if not partial:
        return read_file(f, **load_kw)
    info, _ = current_rank(ranks)
    index = read_index(f)
    if index is None:
        per_replica = replicas(f)
        if per_replica and not os.path.exists(partial_path(f, info.mp_rank)):
            return merge_partial_objects([_load(r, True, load_kw, ranks)
                                          for r in per_replica])
        return _load_unindexed(f, info, load_kw)
    if info.same_layout(index):
        entry = next((e for e in index["files"] if e["mp_rank"] == info.mp_rank), None)
        if entry is None:
            raise SMPCheckpointError.build(
                "the checkpoint index has no file for this model-parallel rank", info.mp_rank,
                where=index_path(f), fix="the index is damaged; restore it from the save")
        return read_partial_file(f, entry, index["save_id"], **load_kw)
    log.info("resharding %s: saved at pp=%d x tp=%d in %d file(s), loading at pp=%d x tp=%d",
             f, index["pp_degree"], index["tp_degree"], index["num_files"], info.pp_degree,
             info.tp_degree)
    _, objs = load_partial_set(f, **load_kw)
    return merge_partial_objects(objs)
