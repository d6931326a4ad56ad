"""The process group each collective axis of a rewritten graph runs on (``"tp"``, ``"cp"``).

A rewritten graph names its collectives' axis, not a group: it is planned before any group
exists (``smp-fx partition``, the planner) and the same graph runs on every rank of the
axis. The runtime binds each axis once per rank; an unbound axis (or one of a single rank)
makes every collective of that axis the identity, so a rewritten graph computes the
original function in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class AxisGroup:
    """One axis's group on this rank: ``size`` ranks, this one ``rank``."""

    group: Any = None
    size: int = 1
    rank: int = 0

    def active(self) -> bool:
        return self.size > 1 and dist.is_available() and dist.is_initialized()


_AXES: dict[str, AxisGroup] = {}


def axis_group(axis: str) -> AxisGroup:
    """The one ``AxisGroup`` of ``axis`` (bound in place, so modules may hold it)."""
    return _AXES.setdefault(axis, AxisGroup())


def bind(axis: str, group: Any, size: int, rank: int) -> None:
    """Run ``axis``'s collectives on ``group``."""
    found = axis_group(axis)
    found.group, found.size, found.rank = group, size, rank


def unbind_all() -> None:
    """Forget every group (a group and its store must not outlive ``smp.reset``)."""
    for axis in _AXES:
        bind(axis, None, 1, 0)
