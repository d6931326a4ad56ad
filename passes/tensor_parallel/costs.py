"""Per-rank costs of a tensor-parallel graph: split work divided, collectives priced.

The plan built on a rewritten graph must say what one rank does: split nodes do 1/tp of
their work, collectives cost ring time on the spec's link. See docs/tensor_parallel.md,
'Planning with tp'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import torch.fx

from cost_model.collectives import ring_over
from cost_model.node_cost import NodeCost
from cost_model.waves import Gemm
from passes import meta

CommTime = Callable[[float], float]

#: collective -> (forward kind, backward kind); kinds: "all_reduce", "all_gather", None
COLLECTIVES: dict[str, tuple[str | None, str | None]] = {
    "tp_copy": (None, "all_reduce"),
    "tp_reduce": ("all_reduce", None),
    "tp_sum": ("all_reduce", None),
    "tp_gather_last": ("all_gather", None),
    "tp_gather_batch": ("all_gather", "all_gather"),
    "tp_split_batch": (None, "all_gather"),
    "tp_vocab_embedding": ("all_reduce", None),
    "tp_vocab_cross_entropy": ("all_reduce", None),  # max, sum of exp, target logit
    "tp_seq_reduce_scatter": ("reduce_scatter", "all_gather"),
    "tp_seq_gather": ("all_gather", "reduce_scatter"),
    "tp_scatter": (None, "all_gather"),
    "tp_seq_unscatter": ("all_gather", None),
}


CHUNK_OUTPUTS = frozenset({"tp_split_batch", "tp_seq_reduce_scatter", "tp_scatter"})
"""Collectives whose output is this rank's part: the value moved is ``size`` times it."""


def divide(cost: NodeCost, size: int, params: bool = False) -> NodeCost:
    """``cost`` of one of ``size`` ranks sharing the node's work."""
    return dataclasses.replace(
        cost, fwd_flops=cost.fwd_flops / size, bwd_flops=cost.bwd_flops / size,
        fwd_time_s=cost.fwd_time_s / size, bwd_time_s=cost.bwd_time_s / size,
        output_bytes=cost.output_bytes // size, saved_bytes=cost.saved_bytes // size,
        param_bytes=cost.param_bytes // size if params else cost.param_bytes)


def shard_gemm(shapes: tuple[Gemm, Gemm], row: bool, size: int) -> tuple[Gemm, Gemm]:
    """``meta.GEMM`` of a linear's shard: the contraction split (a ``row`` linear) or the
    outputs (column, lone), the shape it was priced at kept for
    ``passes.reprice_gemms``."""
    priced, runs = shapes
    return priced, runs.shard(k_parts=size) if row else runs.shard(n_parts=size)


def divide_saved(gm: torch.fx.GraphModule, split: Collection[str], size: int) -> None:
    """One rank's saved bytes (``meta.SAVED``, in place): a stored value owned by a node in
    ``split`` (its output is held 1/size per rank: feature-split, a column linear's
    output, a sequence chunk) counts 1/size, and so do such a node's extras (masks)."""
    for node in gm.graph.nodes:
        saved = meta.SAVED.get(node)
        if saved is None:
            continue
        keys = tuple((k, b // size if _owner(k) in split else b) for k, b in saved.keys)
        name, nbytes = saved.storage
        meta.SAVED.set(node, dataclasses.replace(
            saved, keys=keys, extra=saved.extra // size if node.name in split else saved.extra,
            storage=(name, nbytes // size if _owner(name) in split else nbytes)))


def rename_saved(node: torch.fx.Node, owner: str, new: str, nbytes: int) -> None:
    """``node`` saves ``new`` (``nbytes``) where it saved ``owner``'s value: a column
    linear fed by a sequence gather keeps the gathered input, not the chunk."""
    saved = meta.SAVED.get(node)
    if saved is not None:
        keys = tuple((new, nbytes) if _owner(k) == owner else (k, b) for k, b in saved.keys)
        meta.SAVED.set(node, dataclasses.replace(saved, keys=keys))


def _owner(key: str) -> str:
    """The node name in a saved-value key (``name``, ``name[i]``, ``name#copyN``)."""
    return key.split("[", 1)[0].split("#", 1)[0]


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
    """Seconds of one ring collective moving ``nbytes`` over ``size`` ranks (the one ring
    formula, ``cost_model.collectives.ring_over``).

    >>> collective_time("all_reduce", 8e6, 2, lambda n: 1e-4 + n / 1e9)
    0.0082
    """
    return ring_over(kind, nbytes, size, comm_time)


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
        if meta.TP.get(node) in CHUNK_OUTPUTS:
            nbytes *= size
        fwd = collective_time(kinds[0], nbytes, size, comm_time)
        bwd = collective_time(kinds[1], nbytes, size, comm_time)
        base = meta.COST.get(node) or NodeCost(op=str(meta.TP.get(node)))
        meta.COST.set(node, dataclasses.replace(base, fwd_time_s=base.fwd_time_s + fwd,
                                                bwd_time_s=base.bwd_time_s + bwd))


__all__ = ["COLLECTIVES", "collective_time", "divide", "divide_saved", "local_info",
           "price_collectives", "rename_saved"]
