"""What a split backward's weight gradient (W) costs and holds, for the plan and simulator.

Between a microbatch's I and W a chunk holds its forward's saved values plus each join's
output gradient (``held_bytes``); W is priced as half the backward of parameter-reading
ops. See docs/schedules.md, 'Memory: activations in flight, and what a pending W holds'.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch.fx

from passes import meta
from passes.shape_prop import total_nbytes

WEIGHT_SHARE = 0.5
"""The share of a parameterised operation's backward time that is its weight gradient."""


@dataclass(frozen=True)
class WeightGrads:
    """One chunk's W per microbatch: seconds, and the bytes a pending W holds beyond the
    chunk's activations (the joins' gradients, the checkpointed regions rebuilt)."""

    time_s: float
    held_bytes: int


def weight_grads(nodes: Sequence[torch.fx.Node], trainable: Collection[str],
                 rebuilt: int = 0) -> WeightGrads:
    """The W account of the chunk made of ``nodes``; ``trainable`` names the parameters
    that get gradients (tied names of one tensor all listed); ``rebuilt``: what recomputing
    the chunk's checkpointed regions rebuilds (``StageActivations.rebuilt``)."""
    grads: dict[str, int] = {}
    time_s = 0.0
    for n in nodes:
        if not any(name in trainable for name in meta.PARAMS.get(n, ()) or ()):
            continue
        cost = meta.COST.get(n) if meta.COST.has(n) else None
        if cost is not None:
            time_s += WEIGHT_SHARE * cost.bwd_time_s
        grads[n.name] = total_nbytes(meta.TENSOR.get(n))
    return WeightGrads(time_s, sum(grads.values()) + rebuilt)


__all__ = ["WEIGHT_SHARE", "WeightGrads", "weight_grads"]
