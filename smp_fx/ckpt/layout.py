"""The partial-checkpoint layout: file names, format markers, the index, a file's save id.

Apart from writing and reading because both, and ``smp-fx checkpoint``, must agree on
exactly these names. See docs/checkpoints.md, 'Files, crash safety and formats'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from cost_model.errors import SMPCheckpointError

PARTIAL_FORMAT = 1
INDEX_FORMAT = "smp-fx-partial-checkpoint"
INDEX_VERSION = 1
WRAP_KEY = "_smp_partial_checkpoint"


def partial_path(f: str, mp_rank: int) -> str:
    """The file of one model-parallel rank in a partial checkpoint (SMP's naming)."""
    return f"{f}_{mp_rank}"


def replica_path(f: str, rdp_rank: int) -> str:
    """The partial checkpoint of one data-parallel replica in a per-rank (v3) save."""
    return f"{f}_rdp{rdp_rank}"


def replicas(f: str) -> list[str]:
    """The replicas' partial checkpoints of the per-rank (v3) save ``f``, in rdp order
    (empty when ``f`` is not one)."""
    found: list[str] = []
    while os.path.exists(index_path(replica_path(f, len(found)))):
        found.append(replica_path(f, len(found)))
    return found


def index_path(f: str) -> str:
    """The index file of a partial checkpoint."""
    return f"{f}.smp_index.json"


def prev_path(path: str) -> str:
    """Where a partial file's committed predecessor waits during a save (commit protocol)."""
    return f"{path}.prev"


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


def file_save_id(path: str) -> str | None:
    """The save id of a partial file, read through mmap so tensors are not loaded."""
    try:
        data = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # unreadable or not ours: it is not the committed file
        return None
    return data.get("save_id") if isinstance(data, Mapping) and WRAP_KEY in data else None


def unwrap(data: Any) -> Any:
    """The saved object of a partial file (a file without the wrapper is its own object)."""
    return data["object"] if isinstance(data, Mapping) and WRAP_KEY in data else data

