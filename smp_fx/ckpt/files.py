"""``smp.save`` / ``smp.load``: checkpoint files, their names, atomic writes, resharding.

Naming (one scheme, documented here and in the README):

* full checkpoint (``partial=False``): exactly ``f``, a plain ``torch.save`` file that
  ``torch.load`` reads without smp-fx; written by model-parallel rank 0 only;
* partial checkpoint (``partial=True``): one file per model-parallel rank, ``f"{f}_{mp_rank}"``
  (as SMP: ``checkpoint.pt_0``, ``checkpoint.pt_1``, ...), plus the index
  ``f"{f}.smp_index.json"``: pipeline and tensor degree, the files and the parameter names
  in each, so a checkpoint saved at one pipeline degree can be loaded at another (the
  files are merged by name). A partial file wraps the saved object with its save id::

      {"_smp_partial_checkpoint": 1, "save_id": "...", "mp_rank": 0, "object": obj}

Crash safety: every file is written to a temporary file in the same directory, flushed,
fsynced, then ``os.replace``d over the target, and the directory is fsynced. A partial save
runs a small commit protocol over the model-parallel group: all ranks write temporaries;
only when every rank succeeded does each move its previous file to ``f"{f}_{r}.prev"`` and
its new one into place; mp rank 0 then writes the index, which is the commit record; then
the ``.prev`` files are deleted. A process killed at any point leaves a set that ``load``
reads consistently: the index names the save id, and a file whose id differs is replaced
by its ``.prev`` twin.

Loading uses ``torch.load(weights_only=True)`` unless told otherwise: what SMP scripts
save (tensors, dicts, lists, tuples, numbers, strings, optimizer and LR-scheduler state
dicts, numpy arrays and scalars) loads safely; an object holding other Python classes needs
``smp.load(..., weights_only=False)``, for files you trust only. Passing a custom
``pickle_module`` asks for that module's unpickler, which the safe loader cannot use, so it
implies ``weights_only=False`` (trusted files only) unless ``weights_only=True`` is given.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPCheckpointError, not_implemented
from smp_fx.ckpt import tp_shards
from smp_fx.ckpt.atomic import atomic_write, fsync_dir, write_temp
from smp_fx.ckpt.state_dict import (
    GROUP_PARAMS_KEY,
    PARTIAL_KEY,
    merge_model_state_dicts,
    merge_optimizer_state_dicts,
    merge_partial_optimizer_states,
)
from smp_fx.ckpt.validate import agreed, load_error
from smp_fx.dist import comm
from smp_fx.dist import state as smp_state

log = logging.getLogger(__name__)

PARTIAL_FORMAT = 1
INDEX_FORMAT = "smp-fx-partial-checkpoint"
INDEX_VERSION = 1
WRAP_KEY = "_smp_partial_checkpoint"

Gather = Callable[[Any], list[Any]]
"""all_gather_object over the model-parallel group: this rank's value -> every rank's."""


def partial_path(f: str, mp_rank: int) -> str:
    """The file of one model-parallel rank in a partial checkpoint (SMP's naming)."""
    return f"{f}_{mp_rank}"


def index_path(f: str) -> str:
    """The index file of a partial checkpoint."""
    return f"{f}.smp_index.json"


def _prev_path(path: str) -> str:
    return f"{path}.prev"


def _torch_writer(obj: Any, pickle_module: Any, protocol: int) -> Callable[[IO[bytes]], None]:
    def write(fh: IO[bytes]) -> None:
        torch.save(obj, fh, pickle_module=pickle_module, pickle_protocol=protocol)
    return write


def _numpy_safe_globals() -> list[Any]:
    """The numpy names an array or scalar is pickled with (its reconstructor and dtypes):
    allowed by the safe loader, as the Hugging Face Trainer allows them for RNG states,
    since scripts save numpy metrics and RNG states beside their tensors."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    kinds = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
             np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
             np.complex128)
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype,
            *(type(np.dtype(k)) for k in kinds)]


def resolve_weights_only(weights_only: bool | None, pickle_module: Any) -> bool:
    """``weights_only`` as given, else safe unless a custom ``pickle_module`` was asked for
    (its own unpickler is what the caller wants, and the safe loader has its own)."""
    if weights_only is not None:
        return weights_only
    return pickle_module is None or pickle_module is pickle


def read_file(path: str, map_location: Any = None, pickle_module: Any = pickle,
              weights_only: bool | None = None, **pickle_load_args: Any) -> Any:
    """``torch.load`` with the safe loader by default; a file it cannot read is an error
    that says what is wrong with the file (``validate.load_error``)."""
    if not os.path.exists(path):
        fix = "check the path (partial files end in _<mp_rank>)"
        if os.path.exists(partial_path(path, 0)):
            fix = f"{path} is a partial checkpoint: load it with partial=True"
        raise SMPCheckpointError.build("checkpoint file does not exist", path, fix=fix)
    safe = resolve_weights_only(weights_only, pickle_module)
    if safe and pickle_module is not pickle and pickle_module is not None:
        raise SMPCheckpointError.build(
            "a custom pickle_module cannot be used with weights_only=True",
            getattr(pickle_module, "__name__", pickle_module), where=path,
            fix="drop weights_only=True to use the module (only for files you trust)")
    try:
        if safe:
            with torch.serialization.safe_globals(_numpy_safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True,
                                  **pickle_load_args)
        return torch.load(path, map_location=map_location, weights_only=False,
                          pickle_module=pickle_module or pickle, **pickle_load_args)
    except Exception as exc:
        raise load_error(path, exc, safe) from exc


# ---------------------------------------------------------------- where this rank is


@dataclass(frozen=True)
class RankInfo:
    """This process's place for checkpointing: which file it writes, which degrees it runs.

    ``num_files`` is the number of processes in the model-parallel group (1 when one
    process runs every stage), so a partial checkpoint has exactly that many files.
    """

    mp_rank: int = 0
    num_files: int = 1
    pp_degree: int = 1
    pp_rank: int = 0
    tp_degree: int = 1
    tp_rank: int = 0


def current_rank() -> tuple[RankInfo, Gather]:
    """RankInfo and the mp-group gather for this process (a world of one before smp.init)."""
    if not smp_state.is_initialized():
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise SMPCheckpointError.build(
                "partial checkpoints in a multi-process job need smp.init",
                f"world size {dist.get_world_size()}", where="smp.save/smp.load",
                fix="call smp.init(config) before saving or loading")
        return RankInfo(), lambda value: [value]
    st = smp_state.get()
    info = RankInfo(mp_rank=st.axis_rank("mp"), num_files=len(st.group_ranks("mp")),
                    pp_degree=st.axis_size("pp"), pp_rank=st.axis_rank("pp"),
                    tp_degree=st.axis_size("tp"), tp_rank=st.axis_rank("tp"))
    if info.num_files == 1:
        return info, lambda value: [value]
    return info, lambda value: comm.allgather(value, comm.MP_GROUP)  # bounded, named waits


# ------------------------------------------------------------------------- save


def entry_names(obj: Any) -> dict[str, list[str]]:
    """Parameter names held by each partial state dict in ``obj`` (for the index)."""
    def names(sd: Mapping[str, Any]) -> list[str]:
        if GROUP_PARAMS_KEY in sd:
            return [n for g in sd["param_groups"] for n in g["params"]]
        return [str(k) for k in sd if k not in (PARTIAL_KEY, tp_shards.TP_SHARDS_KEY)]

    if isinstance(obj, Mapping) and obj.get(PARTIAL_KEY):
        return {"": names(obj)}
    if isinstance(obj, Mapping):
        return {str(k): names(v) for k, v in obj.items()
                if isinstance(v, Mapping) and v.get(PARTIAL_KEY)}
    return {}


def save_partial(obj: Any, f: str, info: RankInfo, gather: Gather,
                 pickle_module: Any = pickle, pickle_protocol: int = 2) -> None:
    """The partial-save commit protocol (see the module docstring); every mp rank calls it."""
    me = {"mp_rank": info.mp_rank, "pp_rank": info.pp_rank, "tp_rank": info.tp_rank,
          "file": os.path.basename(partial_path(f, info.mp_rank)),
          "entries": entry_names(obj), "save_id": uuid.uuid4().hex}
    files = sorted(gather(me), key=lambda m: m["mp_rank"])
    save_id = files[0]["save_id"]
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "save_id": save_id,
             "pp_degree": info.pp_degree, "tp_degree": info.tp_degree,
             "num_files": info.num_files,
             "files": [{k: v for k, v in m.items() if k != "save_id"} for m in files]}
    target = partial_path(f, info.mp_rank)
    wrapped = {WRAP_KEY: PARTIAL_FORMAT, "save_id": save_id, "mp_rank": info.mp_rank,
               "object": obj}
    tmp: str | None = None
    error: str | None = None
    try:
        tmp = write_temp(target, _torch_writer(wrapped, pickle_module, pickle_protocol))
    except Exception as exc:  # reported to every rank below, then re-raised here
        error = f"{type(exc).__name__}: {exc}"
        failure: BaseException | None = exc
    else:
        failure = None
    statuses = gather(error)
    if any(s is not None for s in statuses) or tmp is None:
        if tmp is not None:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
        bad = {r: s for r, s in enumerate(statuses) if s is not None}
        raise SMPCheckpointError.build(
            "partial checkpoint not saved: writing failed on model-parallel rank(s)", bad,
            where=f"{f} (mp_rank {info.mp_rank})",
            fix="fix the cause on those ranks; the previous checkpoint is unchanged") from failure
    _keep_committed(f, target)
    os.replace(tmp, target)
    directory = os.path.dirname(os.path.abspath(target))
    fsync_dir(directory)
    gather("renamed")
    if info.mp_rank == 0:
        text = json.dumps(index, indent=1, sort_keys=True).encode()
        atomic_write(index_path(f), lambda fh: fh.write(text))
    gather("committed")
    with suppress(FileNotFoundError):
        os.unlink(_prev_path(target))
    _remove_stale_temporaries(target)


def _remove_stale_temporaries(target: str) -> None:
    """Delete temporaries of ``target`` left by killed saves (only this rank writes it)."""
    directory = os.path.dirname(os.path.abspath(target))
    prefix = f".{os.path.basename(target)}."
    for name in os.listdir(directory):
        if name.startswith(prefix) and name.endswith(".tmp"):
            with suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def _keep_committed(f: str, target: str) -> None:
    """Move this rank's committed file to ``.prev`` before the new one takes its name.

    If ``.prev`` already exists and ``target`` is not the file the index commits (a save
    was interrupted after its rename), ``.prev`` is the committed one and is kept.
    """
    if not os.path.exists(target):
        return
    index = read_index(f)
    prev = _prev_path(target)
    if index is not None and os.path.exists(prev) and \
            _file_save_id(target) != index["save_id"]:
        os.unlink(target)
    else:
        os.replace(target, prev)


def save(obj: Any, f: str, partial: bool = True, pickle_module: Any = pickle,
         pickle_protocol: int = 2, v3: bool = False) -> None:
    """Save ``obj`` as SMP does: per model-parallel rank files when ``partial``.

    Call it on the ranks with ``smp.dp_rank() == 0`` (every mp rank of that group when
    ``partial=True``: it is collective over the model-parallel group). With
    ``partial=False`` only mp rank 0 writes ``f``; other ranks return at once.
    ``v3=True`` is SMP 1.10's format for sharded optimizer state (a file per rank, data
    parallel ranks included), which needs ``shard_optimizer_state``: not built yet, so it
    raises ``SMPNotImplementedError``; ``v3=False`` (what the Hugging Face Trainer passes
    without sharding) is the format above.

    Example::

        smp.save({"model_state_dict": model.local_state_dict(),
                  "optimizer_state_dict": optimizer.local_state_dict()},
                 "/ckpt/checkpoint.pt", partial=True)
    """
    f = _check_path(f)
    if v3:
        raise not_implemented("smp.save(..., v3=True): per-rank files of sharded optimizer "
                              "state", "shard_optimizer_state",
                              "save with v3=False (the optimizer state is not sharded)")
    if partial:
        info, gather = current_rank()
        save_partial(obj, f, info, gather, pickle_module, pickle_protocol)
        return
    if smp_state.is_initialized() and smp_state.get().axis_rank("mp") != 0:
        return
    atomic_write(f, _torch_writer(obj, pickle_module, pickle_protocol))


def _check_path(f: Any) -> str:
    if isinstance(f, os.PathLike):
        f = os.fspath(f)
    if not isinstance(f, str):
        raise SMPCheckpointError.build(
            "smp.save/smp.load take a file name (str), not a file object", type(f).__name__,
            fix="pass a path; per-rank files are derived from it")
    return f


# ------------------------------------------------------------------------- load


def read_index(f: str) -> dict[str, Any] | None:
    """The index of the partial checkpoint ``f``, or None when there is none."""
    path = index_path(f)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            index = json.load(fh)
    except (ValueError, OSError) as exc:
        raise SMPCheckpointError.build(
            "the checkpoint index cannot be read", str(exc), path,
            "restore it with the partial files it belongs to (it is rewritten by every "
            "smp.save(partial=True))") from exc
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT \
            or index.get("version") != INDEX_VERSION:
        index = index if isinstance(index, dict) else {}
        raise SMPCheckpointError.build(
            "unknown checkpoint index format", (index.get("format"), index.get("version")),
            where=path, fix=f"use an index written by this smp-fx ({INDEX_FORMAT} v1)")
    return index


def _file_save_id(path: str) -> str | None:
    """The save id of a partial file, read through mmap so tensors are not loaded."""
    try:
        data = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # unreadable or not ours: it is not the committed file
        return None
    return data.get("save_id") if isinstance(data, Mapping) and WRAP_KEY in data else None


def _unwrap(data: Any) -> Any:
    return data["object"] if isinstance(data, Mapping) and WRAP_KEY in data else data


def read_partial_file(f: str, entry: Mapping[str, Any], save_id: str,
                      **load_kw: Any) -> Any:
    """The object one mp rank saved under the committed ``save_id`` (its ``.prev`` twin
    when a later save was interrupted before its index was written)."""
    path = os.path.join(os.path.dirname(os.path.abspath(f)), entry["file"])
    candidates = [c for c in (path, _prev_path(path)) if os.path.exists(c)]
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
    return _unwrap(data)


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
         weights_only: bool | None = None, **pickle_load_args: Any) -> Any:
    """Load what ``smp.save`` wrote; with ``partial`` each mp rank reads its own file.

    When the partial checkpoint was saved at another pipeline degree (its index says so),
    every file is read and the state dicts are merged by name (resharding); the model and
    optimizer then take their own parameters.

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
    f = _check_path(f)
    load_kw = dict(map_location=map_location, pickle_module=pickle_module,
                   weights_only=weights_only, **pickle_load_args)
    return agreed(f"smp.load({f!r})", lambda: _load(f, partial, load_kw))


def _load(f: str, partial: bool, load_kw: dict[str, Any]) -> Any:
    """This rank's part of ``load``."""
    if not partial:
        return read_file(f, **load_kw)
    info, _ = current_rank()
    index = read_index(f)
    if index is None:
        return _load_unindexed(f, info, load_kw)
    same = (index["num_files"] == info.num_files and index["pp_degree"] == info.pp_degree
            and index["tp_degree"] == info.tp_degree)
    if same:
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
