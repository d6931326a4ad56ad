"""What a split backward's weight gradient (W) costs and holds, for the plan and simulator.

Zero-bubble schedules run a chunk's backward as I (the gradients of its inputs) and, later,
W (the gradients of its parameters). The runtime splits each operation that reads a
trainable parameter: I computes its input gradient and keeps the output gradient it was
given; W later computes the weight gradient from it and from what the operation saved.
So between a microbatch's I and its W a chunk holds, per parameterised operation, the
values it saved for backward (once per storage, as ``stage_activations`` counts them) and
the gradient of its output. Inside an activation-checkpointed region these are the values
the recompute rebuilt during I: they are counted the same way, and nothing is recomputed
again for W.

W's time is estimated as half the backward time of those operations: a matmul's backward
is two matmuls of its forward's size, one for each gradient; element-wise parameterised
operations (norms, biases) are cheap either way.
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
    """One chunk's W per microbatch: seconds, and bytes held from its I until it runs."""

    time_s: float
    held_bytes: int


def weight_grads(nodes: Sequence[torch.fx.Node], trainable: Collection[str]) -> WeightGrads:
    """The W account of the chunk made of ``nodes``; ``trainable`` names the parameters
    that get gradients (tied names of one tensor all listed)."""
    held: dict[str, int] = {}
    extra = 0
    time_s = 0.0
    for n in nodes:
        if not any(name in trainable for name in meta.PARAMS.get(n, ()) or ()):
            continue
        cost = meta.COST.get(n) if meta.COST.has(n) else None
        if cost is not None:
            time_s += WEIGHT_SHARE * cost.bwd_time_s
        saved = meta.SAVED.get(n)
        if saved is not None:
            held.update(saved.keys)
            extra += saved.extra
        elif cost is not None:
            extra += cost.saved_bytes
        held[f"{n.name}#grad"] = total_nbytes(meta.TENSOR.get(n))
    return WeightGrads(time_s, sum(held.values()) + extra)


__all__ = ["WEIGHT_SHARE", "WeightGrads", "weight_grads"]
