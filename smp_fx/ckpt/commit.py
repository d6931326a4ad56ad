"""Writing a partial checkpoint: the commit protocol over the model-parallel group.

A process killed at any point leaves a set that loads consistently.
See docs/checkpoints.md, 'Files, crash safety and formats'.
"""

from __future__ import annotations

import json
import os
import pickle
import uuid
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import IO, Any

import torch

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt import tp_shards
from smp_fx.ckpt.atomic import atomic_write, fsync_dir, write_temp
from smp_fx.ckpt.layout import (
    INDEX_FORMAT,
    INDEX_VERSION,
    PARTIAL_FORMAT,
    WRAP_KEY,
    file_save_id,
    index_path,
    partial_path,
    prev_path,
    read_index,
)
from smp_fx.ckpt.ranks import Gather, RankInfo
from smp_fx.ckpt.state_dict import GROUP_PARAMS_KEY, PARTIAL_KEY


def torch_writer(obj: Any, pickle_module: Any, protocol: int) -> Callable[[IO[bytes]], None]:
    """``torch.save`` of ``obj`` into an open file (what ``atomic_write`` calls)."""
    def write(fh: IO[bytes]) -> None:
        torch.save(obj, fh, pickle_module=pickle_module, pickle_protocol=protocol)
    return write



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


def index_entry(obj: Any, f: str, info: RankInfo) -> dict[str, Any]:
    """This rank's entry in the index of a partial save of ``obj`` (what the model-parallel
    ranks gather)."""
    return {"mp_rank": info.mp_rank, "pp_rank": info.pp_rank, "tp_rank": info.tp_rank,
            "file": os.path.basename(partial_path(f, info.mp_rank)),
            "entries": entry_names(obj), "save_id": uuid.uuid4().hex}


def prepare_partial(obj: Any, f: str, info: RankInfo, gather: Gather
                    ) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """This rank's file name, its wrapped object and the index of a partial save of ``obj``
    (one gather over the model-parallel group: every mp rank calls it)."""
    files = sorted(gather(index_entry(obj, f, info)), key=lambda m: m["mp_rank"])
    save_id = files[0]["save_id"]
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "save_id": save_id,
             "pp_degree": info.pp_degree, "tp_degree": info.tp_degree,
             "num_files": info.num_files,
             "files": [{k: v for k, v in m.items() if k != "save_id"} for m in files]}
    if info.placement:  # chunks on the ranks (virtual_pipeline_degree > 1)
        index["placement"] = list(info.placement)
    wrapped = {WRAP_KEY: PARTIAL_FORMAT, "save_id": save_id, "mp_rank": info.mp_rank,
               "object": obj}
    return partial_path(f, info.mp_rank), wrapped, index


def index_writer(index: dict[str, Any]) -> Callable[[IO[bytes]], object]:
    """The index file's bytes (what ``atomic_write`` calls)."""
    text = json.dumps(index, indent=1, sort_keys=True).encode()
    return lambda fh: fh.write(text)


def save_partial(obj: Any, f: str, info: RankInfo, gather: Gather,
                 pickle_module: Any = pickle, pickle_protocol: int = 2) -> None:
    """The partial-save commit protocol (see the module docstring); every mp rank calls it."""
    target, wrapped, index = prepare_partial(obj, f, info, gather)
    tmp: str | None = None
    error: str | None = None
    try:
        tmp = write_temp(target, torch_writer(wrapped, pickle_module, pickle_protocol))
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
        atomic_write(index_path(f), index_writer(index))
    gather("committed")
    with suppress(FileNotFoundError):
        os.unlink(prev_path(target))
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
    """Move this rank's committed file to ``.prev`` before the new one takes its name (an
    existing ``.prev`` is kept when it is the committed one)."""
    if not os.path.exists(target):
        return
    index = read_index(f)
    prev = prev_path(target)
    if index is not None and os.path.exists(prev) and \
            file_save_id(target) != index["save_id"]:
        os.unlink(target)
    else:
        os.replace(target, prev)

