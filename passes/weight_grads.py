"""What a split backward's weight gradient (W) costs and holds, for the plan and simulator.

Zero-bubble schedules run a chunk's backward as I (the gradients of its inputs) and, later,
W (the gradients of its parameters), both from the autograd graph the forward recorded
(``smp_fx.runtime.executor.split_backward``). I keeps that graph: between a microbatch's I and
its W
the chunk still holds everything its forward saved, plus

- the gradient each *join* was given during I (an operation where a parameter's path meets
  the input path, a linear's matmul): one tensor the size of the operation's output;
- in an activation-checkpointed region, what the recompute during I rebuilt: the region's
  own saved values, kept for the W (``smp_fx.runtime.memory.recompute_once``), so nothing is
  recomputed twice.

So a pending W holds the chunk's activations per microbatch, plus ``held_bytes`` on top
(``MemoryBreakdown.pending_w_per_microbatch`` is their sum); W releases all of it.

W's time is estimated as half the backward time of the operations that read a trainable
parameter: a matmul's backward is two matmuls of its forward's size, one per gradient;
element-wise parameterised operations (norms, biases) are cheap either way.
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
