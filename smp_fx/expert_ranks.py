"""Expert parallelism's rank arithmetic: the ep groups carved out of the rdp ranks.

Pure (no torch.distributed), so layouts are checked without processes. An rdp group of R
ranks (one pipeline stage, one tp shard) is cut into R / ep consecutive *ep groups* of
``ep`` ranks; each holds every expert once, num_experts / ep per rank. The ranks at the
same place in every ep group hold the same experts: they form an *edp group* (expert
data parallel) of R / ep ranks, over which those experts' gradients are reduced. With
rdp ranks [0, 1, 2, 3] and ep = 2: ep groups [0, 1], [2, 3]; edp groups [0, 2], [1, 3].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cost_model.errors import SMPConfigError

KEY = "expert_parallel_degree"


def expert_parallel_refusal(values: Mapping[str, Any], where: str) -> SMPConfigError | None:
    """Why ``values`` (every parameter, resolved) cannot run expert parallelism, or None."""
    ep = values[KEY]
    if ep == 1 or values["ddp"]:
        return None
    return SMPConfigError.build(f"'{KEY}' > 1 requires 'ddp': true (the ep group is carved "
                                "out of the data-parallel ranks)", ep, where, "set 'ddp': true")


def check_ep_divides(ep: int, rdp: int, world_size: int, mp: int) -> None:
    """The ep group is carved out of the rdp ranks: ep must divide their number."""
    if rdp % ep != 0:
        raise SMPConfigError.build(
            f"'{KEY}' must divide the reduced data-parallel degree (world {world_size} / "
            f"(pipeline x tensor parallel) {mp} = {rdp})", ep, KEY,
            f"use a divisor of {rdp}, or launch {mp * ep} x k processes")


def check_experts_divide(ep: int, num_experts: int, where: str) -> None:
    """Each ep rank keeps num_experts / ep experts of a block."""
    if num_experts % ep != 0:
        raise SMPConfigError.build(
            f"'{KEY}' must divide the number of experts of every MoE block", ep,
            f"{where} ({num_experts} experts)",
            f"use a divisor of {num_experts} as '{KEY}'")


def ep_groups(rdp_group: list[int], ep: int) -> list[list[int]]:
    """The ep groups of one rdp group (sorted global ranks): consecutive blocks of ``ep``."""
    return [rdp_group[i:i + ep] for i in range(0, len(rdp_group), ep)]


def edp_groups(rdp_group: list[int], ep: int) -> list[list[int]]:
    """The edp groups of one rdp group: ranks at the same place in every ep group."""
    return [list(col) for col in zip(*ep_groups(rdp_group, ep))]


def ep_rank(rdp_rank: int, ep: int) -> int:
    """The place of an rdp rank in its ep group: which slice of the experts it holds."""
    return rdp_rank % ep


def expert_slice(num_experts: int, ep: int, rank: int) -> range:
    """The experts ep rank ``rank`` holds (contiguous, num_experts / ep of them)."""
    local = num_experts // ep
    return range(rank * local, (rank + 1) * local)


def table(rdp_group: list[int], ep: int) -> str:
    """One row per rank of an rdp group: its ep rank (which experts) and its ep group."""
    rows = ["rank ep_rank ep_group"]
    for i, r in enumerate(rdp_group):
        rows.append(f"{r:<4} {ep_rank(i, ep):<7} {i // ep}")
    return "\n".join(rows)
