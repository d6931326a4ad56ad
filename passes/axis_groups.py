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

import torch
import torch.distributed as dist


@dataclass
class AxisGroup:
    """One axis's group on this rank: ``size`` ranks, this one ``rank``."""

    group: Any = None
    size: int = 1
    rank: int = 0

    def active(self) -> bool:
        return self.size > 1 and dist.is_available() and dist.is_initialized()

    def all_reduce(self, x: torch.Tensor, op: Any = None) -> torch.Tensor:
        """``x`` reduced over the group (a sum, or ``op``), as a new tensor."""
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=self.group)
        return out


class Summed(torch.autograd.Function):
    """``x`` summed over an axis's group; the gradient passes through (each rank's backward
    covers its own part of the same sum): ``Summed.apply(x, axis_group(...))``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: AxisGroup) -> torch.Tensor:
        return axis.all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


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
