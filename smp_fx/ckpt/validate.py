"""Loading a checkpoint safely: a bad file is one clear error, on every rank, never a hang.

See docs/checkpoints.md, 'Files, crash safety and formats'.

>>> agreed("a load", lambda: 42, Ranks())   # a world of one: nothing to agree with
42
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import TypeVar

from cost_model.errors import SMPCheckpointError, first_line
from smp_fx.ckpt.view import Ranks

T = TypeVar("T")

ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
ZIP_END = b"PK\x05\x06"  # its last record: absent when the file was cut short
_END_SPAN = 65_557  # the end record (22 bytes) plus the longest archive comment
RESTORE = "restore it from a good copy, or load the previous checkpoint"


def load_error(path: str, exc: BaseException, weights_only: bool) -> SMPCheckpointError:
    """What is wrong with the file at ``path`` that ``torch.load`` failed on with ``exc``."""
    said = first_line(exc)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(4)
            fh.seek(max(0, size - _END_SPAN))
            tail = fh.read()
    except OSError as io_exc:
        return SMPCheckpointError.build(
            "the checkpoint file cannot be read", str(io_exc), path,
            "check the path and its permissions")
    if size == 0:
        return SMPCheckpointError.build(
            "the checkpoint file is empty", path,
            fix=f"a save was interrupted or the disk filled up: {RESTORE}")
    if head != ZIP_MAGIC:
        return SMPCheckpointError.build(
            "the file is not a checkpoint: it is not in torch.save's format", path,
            fix="pass the name smp.save was given (partial files are NAME_<mp_rank>; "
            f"NAME.smp_index.json is their index, not a checkpoint); torch said: {said}")
    if ZIP_END not in tail:
        return SMPCheckpointError.build(
            "the checkpoint file is truncated: its end is missing", f"{path}, {size} bytes",
            fix=f"it was cut short (an interrupted copy or save, a full disk): {RESTORE}")
    if weights_only and isinstance(exc, pickle.UnpicklingError):
        return SMPCheckpointError.build(
            "the checkpoint holds objects the safe (weights_only) loader refuses", path,
            fix="if you trust the file, load it with smp.load(..., weights_only=False), or "
            "set SMP_FX_TRUST_CHECKPOINTS=1 (smp.resume_from_checkpoint); Hugging Face "
            f"configs and argparse.Namespace load without it; torch said: {said}")
    return SMPCheckpointError.build(
        "torch.load cannot read the checkpoint file", said, path,
        "if the file is intact, torch's words say why (a class not importable here, a "
        f"device this machine lacks: see map_location); if it is damaged, {RESTORE}")


def agree_or_raise(error: BaseException | None, what: str, ranks: Ranks) -> None:
    """Every rank learns whether ``what`` failed anywhere; if it did, every rank raises the
    same ``SMPCheckpointError`` naming the failed ranks (collective over the world group)."""
    gather = ranks.world_gather()
    mine = said(error)
    raise_failures([mine] if gather is None else gather(mine), error, what)


def said(error: BaseException | None) -> str | None:
    """What a rank tells the others of its failure (None: none)."""
    if error is None:
        return None
    return str(error) if isinstance(error, SMPCheckpointError) else \
        f"{type(error).__name__}: {error}"


def raise_failures(outcomes: list[str | None], error: BaseException | None,
                   what: str) -> None:
    """The same ``SMPCheckpointError`` on every rank naming the ranks whose outcome (from
    ``said``, gathered in world-rank order) is a failure; nothing when none is."""
    failed = {r: m for r, m in enumerate(outcomes) if m is not None}
    if not failed:
        return
    if len(outcomes) == 1 and isinstance(error, SMPCheckpointError):
        raise error
    told = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
    here = "" if error is not None else " (this rank's part loaded)"
    raise SMPCheckpointError(
        f"{what} failed on {len(failed)} of {len(outcomes)} rank(s){here}; {told}") from error


def agreed(what: str, fn: Callable[[], T], ranks: Ranks) -> T:
    """Run this rank's part of a load, then ``agree_or_raise`` on the outcome."""
    try:
        result = fn()
    except Exception as exc:  # shared with every rank below, then raised on every rank
        agree_or_raise(exc, what, ranks)
        raise
    agree_or_raise(None, what, ranks)
    return result
