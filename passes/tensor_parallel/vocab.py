"""Vocabulary-parallel embeddings: an embedding's rows split across the tp group.

The token embedding (and its tied LM head) is often the largest tensor; a vocabulary the
degree does not divide is padded and ``state_dict()`` holds it unpadded; ``padding_idx``
keeps its meaning on the rank holding it. See docs/tensor_parallel.md, 'The rewrite'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from passes import meta
from passes.tensor_parallel import collectives, costs, graph
from passes.tensor_parallel.plan import ShardSpec

EMBEDDING_FUNCTIONS: frozenset[Any] = frozenset({F.embedding})
ATEN_EMBEDDING = torch.ops.aten.embedding.default


@dataclass
class Embedding:
    node: torch.fx.Node
    weight: str  # FQN of the weight
    value: torch.Tensor  # the full weight
    ids: torch.fx.Node
    options: bool  # max_norm, scale_grad_by_freq or sparse is set
    padding_idx: int | None = None  # the row whose gradient stays zero (>= 0)


F_EMBEDDING_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type",
                    "scale_grad_by_freq", "sparse")
ATEN_EMBEDDING_ARGS = ("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse")


def as_embedding(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Embedding | None:
    """``n`` as an embedding lookup on a parameter, or None."""
    if n.op == "call_module" and type(graph.attr(gm, str(n.target))) is nn.Embedding:
        mod = graph.attr(gm, str(n.target))
        options = mod.max_norm is not None or mod.scale_grad_by_freq or mod.sparse
        ids = n.args[0]
        return Embedding(n, f"{n.target}.weight", mod.weight, ids, bool(options),
                         mod.padding_idx) if isinstance(ids, torch.fx.Node) else None
    if n.op != "call_function" or n.target not in EMBEDDING_FUNCTIONS | {ATEN_EMBEDDING}:
        return None
    names = ATEN_EMBEDDING_ARGS if n.target is ATEN_EMBEDDING else F_EMBEDDING_ARGS
    a: dict[str, Any] = {**dict(zip(names, n.args)), **n.kwargs}
    ids, w = a.get("indices", a.get("input")), a.get("weight")
    if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"
            and isinstance(ids, torch.fx.Node)):
        return None
    value = graph.attr(gm, str(w.target))
    options = a.get("max_norm") is not None or bool(a.get("scale_grad_by_freq")) or \
        bool(a.get("sparse"))
    pad = a.get("padding_idx")
    if n.target is ATEN_EMBEDDING and pad == -1:
        pad = None  # aten's "no padding row"
    elif isinstance(pad, int) and pad < 0:
        pad += int(value.shape[0])
    return Embedding(n, str(w.target), value, ids, options,
                     pad if isinstance(pad, int) else None)


def find(gm: torch.fx.GraphModule, in_region: Callable[[torch.fx.Node], bool]
         ) -> list[Embedding]:
    return [e for n in gm.graph.nodes if in_region(n) and (e := as_embedding(gm, n))]


def reason(emb: Embedding, size: int) -> str | None:
    """Why ``emb`` cannot be split over ``size`` ranks (None: it can; a vocabulary the
    degree does not divide is padded)."""
    rows = int(emb.value.shape[0])
    if emb.options:
        return (f"{emb.weight}: an embedding option (max_norm, scale_grad_by_freq, sparse) "
                "is set, which the vocabulary split does not keep")
    if rows < size:
        return f"{emb.weight} has {rows} rows, fewer than tensor_parallel_degree {size}"
    return None


def padding(rows: int, size: int) -> int:
    """Zero rows appended so that ``size`` ranks hold ``ceil(rows / size)`` rows each."""
    return -rows % size


def rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node, emb: Embedding, size: int,
            rank: int, gather: bool, ties: graph.Ties) -> ShardSpec:
    """Replace ``node`` by this rank's vocab-parallel lookup (the table padded to a
    multiple of ``size`` rows); the shard's spec for the plan."""
    g = gm.graph
    if node.op == "call_module":
        graph.replace_module(gm, str(node.target))
    rows = int(emb.value.shape[0])
    pad = padding(rows, size)
    local_rows = (rows + pad) // size
    graph.set_param(gm, emb.weight,
                    graph.shard(graph.pad(emb.value, 0, pad), 0, size, rank),
                    original=emb.value, ties=ties)
    ids = emb.ids
    with g.inserting_before(node):
        if gather:
            ids = graph.insert(g, collectives.tp_gather_batch, (ids,), node, size)
        w = graph.get_attr(g, emb.weight, node)
        y = g.call_function(collectives.tp_vocab_embedding,
                            (ids, w, rank * local_rows, emb.padding_idx))
    y.meta = dict(node.meta)
    meta.TP.set(y, "tp_vocab_embedding")
    meta.PARAMS.set(y, (emb.weight,))
    meta.TENSOR.set(y, costs.local_info(meta.TENSOR.get(node), 0 if gather else None,
                                        size, grow=True))
    cost = meta.COST.get(node)
    if cost is not None:  # each rank looks up every id; its table is its padded rows
        meta.COST.set(y, dataclasses.replace(
            cost, param_bytes=cost.param_bytes * local_rows // rows))
    out = y
    if gather:
        with g.inserting_after(y):
            out = graph.insert(g, collectives.tp_split_batch, (y,), node, size)
    graph.replace_node(g, node, out)
    return ShardSpec(emb.weight, 0, size, tuple(emb.value.shape), pad=pad)


__all__ = ["Embedding", "as_embedding", "find", "padding", "reason", "rewrite"]
