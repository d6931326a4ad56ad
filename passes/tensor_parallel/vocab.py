"""Vocabulary-parallel embeddings: an embedding's rows split across the tp group.

Why: in a language model the token embedding (and the LM head tied to it) is often the
largest single tensor. A marked ``nn.Embedding`` (or ``F.embedding`` / ``aten.embedding``
on a parameter) keeps ``vocab / tp`` rows per rank: each rank looks up the ids that fall in
its rows, zeroes the others, and the partial embeddings are summed over the group
(``collectives.tp_vocab_embedding``). An LM head whose weight *is* that embedding's
(GPT's tied ``lm_head``) is then a lone column-parallel linear over the same rows, so the
two names keep sharing one shard (``graph.Ties``) and the logits are gathered.

A vocabulary ``V`` the degree does not divide is padded to ``ceil(V / tp) * tp`` rows
(zero rows appended; ``ShardSpec.pad`` records how many): each rank holds
``ceil(V / tp)`` rows, the padding rows are never looked up (ids < V) and the tied LM
head's gathered logits are sliced back to ``V`` columns, so their gradients stay zero and
``state_dict()`` / checkpoints hold the unpadded table (``merge_shards``, ``tp_shards``).

A loss the model's forward takes of those logits is computed without gathering them
(``passes.tensor_parallel.loss``). Not built: embedding options (``padding_idx``, ``max_norm``,
``scale_grad_by_freq``, ``sparse``): such an embedding leaves its region replicated, with
the reason.
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
    options: bool  # a non-default option (padding_idx, max_norm, ...) is set


def as_embedding(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Embedding | None:
    """``n`` as an embedding lookup on a parameter, or None."""
    if n.op == "call_module" and type(graph.attr(gm, str(n.target))) is nn.Embedding:
        mod = graph.attr(gm, str(n.target))
        options = (mod.padding_idx is not None or mod.max_norm is not None
                   or mod.scale_grad_by_freq or mod.sparse)
        ids = n.args[0]
        return Embedding(n, f"{n.target}.weight", mod.weight, ids, bool(options)) \
            if isinstance(ids, torch.fx.Node) else None
    if n.op != "call_function" or n.target not in EMBEDDING_FUNCTIONS | {ATEN_EMBEDDING}:
        return None
    ids, w = (n.args[1], n.args[0]) if n.target is ATEN_EMBEDDING else (n.args[0], n.args[1])
    if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"
            and isinstance(ids, torch.fx.Node)):
        return None
    extra = list(n.args[2:]) + list(n.kwargs.values())
    options = any(a not in (None, False, -1, 2.0) for a in extra)
    return Embedding(n, str(w.target), graph.attr(gm, str(w.target)), ids, options)


def find(gm: torch.fx.GraphModule, in_region: Callable[[torch.fx.Node], bool]
         ) -> list[Embedding]:
    return [e for n in gm.graph.nodes if in_region(n) and (e := as_embedding(gm, n))]


def reason(emb: Embedding, size: int) -> str | None:
    """Why ``emb`` cannot be split over ``size`` ranks (None: it can; a vocabulary the
    degree does not divide is padded)."""
    rows = int(emb.value.shape[0])
    if emb.options:
        return (f"{emb.weight}: an embedding option (padding_idx, max_norm, "
                "scale_grad_by_freq, sparse) is set; vocab parallelism takes the defaults")
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
                            (ids, w, rank * local_rows))
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
