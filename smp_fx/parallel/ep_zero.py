"""ZeRO-1 (``shard_optimizer_state``) at ``expert_parallel_degree`` > 1.

An expert slice differs between the ranks of an ep group, so its optimizer state can only
be divided among the ranks holding the same experts: its edp group. Every other parameter
is divided over the whole rdp group, as without experts. Each owner steps and broadcasts
its parameters within the group that divided them. The norm of the owned gradients summed
over rdp counts every expert slice once (its one owner in each edp group).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from smp_fx.parallel.zero import OptimizerShards, ZeroGroup
from smp_fx.parallel.zero import shard_state as zero_shard_state
from smp_fx.world import expert_groups


class ExpertShards(OptimizerShards):
    """The rest over rdp (this class's own division) and the expert slices over edp."""

    def __init__(self, params: Sequence[torch.Tensor], zero: ZeroGroup,
                 experts: Collection[int]) -> None:
        super().__init__([p for p in params if id(p) not in experts], zero.group, zero.ranks,
                         zero.index)
        edp = expert_groups.get_edp_group()
        self.experts = OptimizerShards(
            [p for p in params if id(p) in experts], expert_groups.get_edp_process_group(),
            edp, edp.index(zero.ranks[zero.index]))

    def owns(self, param: torch.Tensor) -> bool:
        return super().owns(param) or self.experts.owns(param)

    def broadcast(self) -> None:
        super().broadcast()
        self.experts.broadcast()


def shard_state(params: Sequence[torch.Tensor], zero: ZeroGroup | None,
                experts: Collection[int]) -> OptimizerShards | None:
    """ZeRO-1's division of ``params`` (``experts``: ids of the expert slices among them),
    or None without a ZeRO-1 group."""
    if zero is None or not experts:
        return zero_shard_state(params, zero)
    return ExpertShards(params, zero, experts)
