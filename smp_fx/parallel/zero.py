"""``shard_optimizer_state``: ZeRO stage 1 over each stage's reduced data-parallel group.

Each parameter is owned by one rdp rank, whose narrowed torch optimizer steps it and
broadcasts it; whole parameters are the unit, and the user's optimizer object stays (an
LR scheduler built on it keeps working). See docs/precision.md, 'shard_optimizer_state'.

>>> assign_owners([10, 7, 5, 3, 1], 2)
[0, 1, 1, 0, 1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from smp_fx.world import state

AXIS = "rdp"
"""The group a stage's optimizer state is sharded over: the ranks holding equal tensors."""


def assign_owners(numels: Sequence[int], n: int) -> list[int]:
    """The owning rank (0..n-1) of each parameter: largest first to the least-loaded rank,
    ties to the lower index; a pure function of the sizes, so every rank computes it."""
    loads = [0] * n
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda j: (-numels[j], j)):
        r = min(range(n), key=lambda k: (loads[k], k))
        owner[i] = r
        loads[r] += numels[i]
    return owner


@dataclass(frozen=True)
class ZeroGroup:
    """The rdp group ZeRO-1 divides an optimizer's state over, and this rank's index in it."""

    group: Any
    ranks: tuple[int, ...]
    index: int


def zero_group(st: state.State) -> ZeroGroup | None:
    """This rank's ZeRO-1 group, or None without ``shard_optimizer_state`` or with a single
    rdp rank. The rdp group's ranks hold the same tensor-parallel shards."""
    ranks = st.group_ranks(AXIS)
    if not st.config.shard_optimizer_state or len(ranks) == 1:
        return None
    return ZeroGroup(st.group(AXIS), tuple(ranks), st.axis_rank(AXIS))


def shard_state(params: Sequence[torch.Tensor], zero: ZeroGroup | None
                ) -> OptimizerShards | None:
    """ZeRO-1 where an optimizer binds to its model: ``params`` (its local parameters)
    divided among ``zero``'s ranks, or None without a ZeRO-1 group."""
    if zero is None:
        return None
    return OptimizerShards(params, zero.group, zero.ranks, zero.index)


def broadcast_flat(tensors: Sequence[torch.Tensor], src: int, group: Any) -> None:
    """Broadcast ``tensors`` from global rank ``src`` over ``group``, one message per dtype
    and device, and write them back in place on the receivers."""
    _finish(_start(tensors, src, group))


_Pending = list[tuple[Any, torch.Tensor, list[torch.Tensor], int]]


def _start(tensors: Sequence[torch.Tensor], src: int, group: Any) -> _Pending:
    pending: _Pending = []
    for same in _by_kind(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        work = dist.broadcast(flat, src=src, group=group, async_op=True)
        pending.append((work, flat, same, src))
    return pending


def _finish(pending: _Pending) -> None:
    me = dist.get_rank()
    for work, flat, same, src in pending:
        work.wait()
        if me == src:
            continue
        offset = 0
        with torch.no_grad():
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class OptimizerShards:
    """One stage's parameters divided among the ranks of its rdp group (``ranks``, global
    ranks in rdp order; this process is ``ranks[index]``)."""

    def __init__(self, params: Sequence[torch.Tensor], group: Any, ranks: Sequence[int],
                 index: int) -> None:
        self.params = list(params)
        self.group = group
        self.ranks = list(ranks)
        self.index = index
        self.owner = assign_owners([p.numel() for p in self.params], len(self.ranks))
        self._owned = {id(p) for p, o in zip(self.params, self.owner) if o == index}

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._owned

    def broadcast(self) -> None:
        """Every owner sends its parameters' new values to the rest of the group."""
        pending: _Pending = []
        for r, src in enumerate(self.ranks):
            mine = [p for p, o in zip(self.params, self.owner) if o == r]
            if mine:
                pending += _start(mine, src, self.group)
        _finish(pending)


def _by_kind(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device],
                                                        list[torch.Tensor]]:
    out: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.dtype, t.device), []).append(t)
    return out
