"""Per-rank costs of a tensor-parallel graph: split work divided, collectives priced.

Why: ``passes.tensor_parallel`` rewrites each rank's graph after the stages are chosen; the
plan built on that graph must say what *one rank* does. Parameter bytes follow from the
sharded tensors themselves; the rest is here:

* ``divide``: a node whose work is split across the tp ranks (a sharded linear, an
  element-wise op on a feature-split value) does 1/tp of its FLOPs, time, output and saved
  bytes (and of its parameter bytes, for a sharded linear);
* ``price_collectives``: each collective node of ``passes.tp_collectives`` costs link time
  on the spec's link model (``comm_time(nbytes)`` = latency + bytes / bandwidth), as ring
  collectives do: an all-reduce of ``n`` bytes over ``p`` ranks is ``2 (p - 1)`` messages
  of ``n / p``, an all-gather to ``n`` bytes ``p - 1`` of them. The all-reduce of
  ``tp_copy`` runs in the backward, that of ``tp_reduce`` in the forward; batch gathers
  (``prescaled_batch: false``) move the gathered bytes forward and back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.fx

from cost_model.node_cost import NodeCost
from passes import meta

CommTime = Callable[[float], float]

#: collective -> (forward kind, backward kind); kinds: "all_reduce", "all_gather", None
COLLECTIVES: dict[str, tuple[str | None, str | None]] = {
    "tp_copy": (None, "all_reduce"),
    "tp_reduce": ("all_reduce", None),
    "tp_gather_last": ("all_gather", None),
    "tp_gather_batch": ("all_gather", "all_gather"),
    "tp_split_batch": (None, "all_gather"),
    "tp_vocab_embedding": ("all_reduce", None),
    "tp_vocab_cross_entropy": ("all_reduce", None),  # max, sum of exp, target logit
}


def divide(cost: NodeCost, size: int, params: bool = False) -> NodeCost:
    """``cost`` of one of ``size`` ranks sharing the node's work."""
    return dataclasses.replace(
        cost, fwd_flops=cost.fwd_flops / size, bwd_flops=cost.bwd_flops / size,
        fwd_time_s=cost.fwd_time_s / size, bwd_time_s=cost.bwd_time_s / size,
        output_bytes=cost.output_bytes // size, saved_bytes=cost.saved_bytes // size,
        param_bytes=cost.param_bytes // size if params else cost.param_bytes)


def local_info(info: Any, dim: int | None, size: int, grow: bool = False) -> Any:
    """``TensorInfo`` of one rank's part of a value split along ``dim`` (``grow``: the
    gathered whole of a part); None and unsplit values pass unchanged."""
    if info is None or dim is None or not getattr(info, "shape", ()):
        return info
    shape = list(info.shape)
    d = dim % len(shape)
    shape[d] = shape[d] * size if grow else shape[d] // size
    nbytes = info.nbytes * size if grow else info.nbytes // size
    return dataclasses.replace(info, shape=tuple(shape), nbytes=nbytes)


def collective_time(kind: str | None, nbytes: float, size: int, comm_time: CommTime) -> float:
    """Seconds of one ring collective moving ``nbytes`` (the full tensor) over ``size`` ranks.

    >>> collective_time("all_reduce", 8e6, 2, lambda n: 1e-4 + n / 1e9)
    0.0082
    """
    if kind is None or size <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (size - 1) if kind == "all_reduce" else size - 1
    return steps * comm_time(nbytes / size)


def price_collectives(gm: torch.fx.GraphModule, size: int, comm_time: CommTime | None) -> None:
    """Add link time to the cost of every collective node of ``gm`` (in place: ``gm`` is
    the pass's own copy), from the bytes of the full value it reduces or gathers
    (``local_info``); a node that also computes (the vocab-parallel lookup) keeps that."""
    for node in gm.graph.nodes:
        kinds = COLLECTIVES.get(str(meta.TP.get(node) or ""))
        if kinds is None:
            continue
        if comm_time is None:
            continue
        info = meta.TENSOR.get(node)  # the output: the full value, but after a split
        nbytes = float(getattr(info, "nbytes", 0) or 0)
        if meta.TP.get(node) == "tp_split_batch":
            nbytes *= size
        fwd = collective_time(kinds[0], nbytes, size, comm_time)
        bwd = collective_time(kinds[1], nbytes, size, comm_time)
        base = meta.COST.get(node) or NodeCost(op=str(meta.TP.get(node)))
        meta.COST.set(node, dataclasses.replace(base, fwd_time_s=base.fwd_time_s + fwd,
                                                bwd_time_s=base.bwd_time_s + bwd))


__all__ = ["COLLECTIVES", "collective_time", "divide", "local_info", "price_collectives"]
