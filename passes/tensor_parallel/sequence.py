"""Sequence parallelism for ``optimize: "memory"``: layer norms, dropout and residuals
between tensor-parallel pairs work on a chunk of the sequence.

Megatron-LM's: each rank holds and saves ``seq / tp`` of the activations between the
pairs at no extra link bytes over an all-reduce; parameters read by chunked ops get their
gradients summed over the group. See docs/tensor_parallel.md, 'Activations between the
pairs'.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from passes import meta
from passes.tensor_parallel import collectives, costs, graph
from passes.tensor_parallel.ops import PASS_THROUGH_FUNCTIONS, elementwise
from passes.tensor_parallel.propagation import grad_flow, shape

ROW_NORMS: frozenset[Any] = frozenset({F.layer_norm, torch.ops.aten.layer_norm.default,
                                       torch.ops.aten.rsqrt.default, torch.rsqrt})
LAST_DIM_MEANS: frozenset[Any] = frozenset({torch.ops.aten.mean.dim, torch.mean, "mean"})
"""RMSNorm on torch.export graphs: ``mean(x.pow(2), [-1], keepdim=True)``, ``rsqrt``."""
ROW_NORM_MODULES: tuple[type, ...] = (nn.LayerNorm,)
BATCH_EDGES = ("tp_split_batch", "tp_gather_batch")
ASSERTIONS: frozenset[Any] = frozenset({torch.ops.aten._assert_tensor_metadata.default})


def _seq_dim(n: torch.fx.Node, size: int, gathered: bool) -> int | None:
    """The sequence dim of ``n``'s value when it can be chunked over ``size`` ranks."""
    s = shape(n)
    if s is None or len(s) < 2:
        return None
    d = len(s) - 2
    length = s[d] * (size if gathered and d == 0 else 1)
    return d if length % size == 0 else None


def _rowwise(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(graph.attr(gm, str(n.target)), ROW_NORM_MODULES) or \
            elementwise(gm, n)
    if n.op == "call_function" and n.target in ROW_NORMS:
        return True
    if n.target in LAST_DIM_MEANS and n.op in ("call_function", "call_method"):
        dims, keep = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim"),
                      n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
        rank = len(shape(n.args[0]) or ())
        return bool(keep) and list(dims if isinstance(dims, (list, tuple)) else [dims]) in (
            [-1], [rank - 1])
    if n.op == "call_function" and n.target in PASS_THROUGH_FUNCTIONS:
        return True
    return elementwise(gm, n)


def _operands_fit(n: torch.fx.Node, chunked: dict[torch.fx.Node, int],
                  entries: list[tuple[torch.fx.Node, torch.fx.Node]]) -> bool:
    """Whether every other tensor operand of ``n`` is chunked alike, broadcast over the
    sequence dim, or replicated with ``n``'s full shape (then it enters by a slice)."""
    out = shape(n)
    if out is None:
        return False
    k = 2  # the sequence dim counted from the end
    for a in n.all_input_nodes:
        if a in chunked:
            if len(shape(a) or ()) != len(out):
                return False
            continue
        s = shape(a)
        if s is None or a.op == "get_attr" or len(s) < k or s[len(s) - k] == 1:
            continue
        if s != out:
            return False
        entries.append((n, a))
    return True


def sequence_parallel(gm: torch.fx.GraphModule, inside: Callable[[torch.fx.Node], bool],
                      size: int, gathered: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Rewrite ``gm`` (the pass's own copy) in place; the names of the parameters whose
    gradients need summing over the tp group, and of the nodes whose values are chunked.
    ``inside``: whether a node belongs to a sharded region; ``gathered``:
    ``prescaled_batch`` false (the regions see the tp group's batch)."""
    kept_whole: set[torch.fx.Node] = set()
    readers = _param_readers(gm)
    while True:
        chunked, entries = _regions(gm, inside, size, gathered, kept_whole)
        mixed = _mixed_readers(readers, chunked)
        if not mixed:
            break
        kept_whole |= mixed
    if not any(meta.TP.get(n) is None for n in chunked) or _exits_outnumber(chunked):
        return (), ()  # nothing but collectives chunked, or more gathers than it saves
    return _rewrite(gm, chunked, entries, size, gathered)


def _regions(gm: torch.fx.GraphModule, inside: Callable[[torch.fx.Node], bool], size: int,
             gathered: bool, kept_whole: set[torch.fx.Node]
             ) -> tuple[dict[torch.fx.Node, int], list[tuple[torch.fx.Node, torch.fx.Node]]]:
    """The chunked nodes (-> their sequence dim) and the operands entering them, no node of
    ``kept_whole`` among them."""
    chunked: dict[torch.fx.Node, int] = {}
    entries: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    for n in gm.graph.nodes:
        if n in kept_whole:
            continue
        role = meta.TP.get(n)
        if role == "tp_reduce":
            d = _seq_dim(n, size, gathered)
            if d is not None:
                chunked[n] = d
            continue
        ins = [a for a in n.all_input_nodes if a in chunked]
        if not ins:
            continue
        if gathered and role in BATCH_EDGES:
            chunked[n] = chunked[ins[0]]  # dropped: the chunked part keeps the gathered batch
            continue
        if n.target in ASSERTIONS:
            chunked[n] = chunked[ins[0]]  # torch.export's dtype check: any chunk passes
            continue
        mine: list[tuple[torch.fx.Node, torch.fx.Node]] = []
        if inside(n) and _rowwise(gm, n) and _operands_fit(n, chunked, mine):
            d = _seq_dim(n, size, gathered)
            if d is not None and d == chunked[ins[0]]:
                chunked[n] = d
                entries += mine
    return chunked, entries


def _params_read(n: torch.fx.Node) -> list[str]:
    """The parameters and buffers ``n`` reads."""
    names = [str(a.target) for a in n.all_input_nodes if a.op == "get_attr"]
    return names + (list(meta.PARAMS.get(n, ()) or ()) if n.op == "call_module" else [])


def _param_readers(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """Each parameter or buffer -> the ops that read it."""
    readers: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            for name in _params_read(n):
                readers.setdefault(name, []).append(n)
    return readers


def _mixed_readers(readers: dict[str, list[torch.fx.Node]],
                   chunked: dict[torch.fx.Node, int]) -> set[torch.fx.Node]:
    """The chunked readers of a parameter that a whole-sequence op reads too (a layer
    shared across depth, ALBERT's, chunked in one call only): its gradient would be summed
    over tp for both, so those readers stay whole."""
    mixed: set[torch.fx.Node] = set()
    for ns in readers.values():
        inner = [n for n in ns if n in chunked]
        if inner and len(inner) < len(ns):
            mixed.update(inner)
    return mixed


def _exits_outnumber(chunked: dict[torch.fx.Node, int]) -> bool:
    """Whether more chunked values leave to replicated consumers (an all-gather each) than
    row outputs are chunked (an all-reduce each becomes a reduce-scatter): then chunking
    would add link traffic, and the part stays replicated."""
    rows = sum(1 for n in chunked if meta.TP.get(n) == "tp_reduce")
    exits = sum(1 for v in chunked if any(
        u not in chunked and meta.TP.get(u) != "tp_copy" and not _shape_read(u)
        for u in v.users))
    return exits > rows


def _insert(gm: torch.fx.GraphModule, fn: Callable[..., Any], x: torch.fx.Node, dim: int,
            like: torch.fx.Node, size: int, grow: bool) -> torch.fx.Node:
    n = graph.insert(gm.graph, fn, (x, dim), like)
    meta.TENSOR.set(n, costs.local_info(meta.TENSOR.get(x), dim, size, grow))
    if not grow:  # a chunk of ``dim``
        meta.TP_SPLIT.set(n, dim)
    return n


def _rewrite(gm: torch.fx.GraphModule, chunked: dict[torch.fx.Node, int],
             entries: list[tuple[torch.fx.Node, torch.fx.Node]], size: int,
             gathered: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    g = gm.graph
    params: list[str] = []
    entered: dict[torch.fx.Node, torch.fx.Node] = {}
    for consumer, operand in entries:
        if operand not in entered:
            with g.inserting_after(operand):
                x = operand
                if gathered:
                    x = graph.insert(g, collectives.tp_gather_batch, (x,), operand,
                                     size)
                with g.inserting_after(x):
                    entered[operand] = _insert(gm, collectives.tp_scatter, x,
                                               chunked[consumer], operand, size, False)
        consumer.replace_input_with(operand, entered[operand])
    _copy_broadcast_operands(gm, chunked, size)
    for n, d in list(chunked.items()):
        role = meta.TP.get(n)
        if role in BATCH_EDGES:
            n.replace_all_uses_with(n.args[0])  # type: ignore[arg-type]
            g.erase_node(n)
            del chunked[n]
            continue
        if role == "tp_reduce":
            n.target = collectives.tp_seq_reduce_scatter
            n.args = (n.args[0], d)
            meta.TP.set(n, "tp_seq_reduce_scatter")
        else:
            cost = meta.COST.get(n)
            if cost is not None:
                meta.COST.set(n, costs.divide(cost, size))
            params += _params_read(n)
        meta.TENSOR.set(n, costs.local_info(meta.TENSOR.get(n), d, size))
        meta.TP_SPLIT.set(n, d)
    names = tuple(n.name for n in chunked)
    for v, d in chunked.items():
        _exits(gm, v, d, chunked, size, gathered)
    return tuple(dict.fromkeys(params)), names


def _copy_broadcast_operands(gm: torch.fx.GraphModule, chunked: dict[torch.fx.Node, int],
                             size: int) -> None:
    """A computed replicated operand of a chunked op that broadcasts over the sequence
    (Gemma's ``1 + weight`` scale of its RMSNorm) gets, on each rank, the gradient of its
    chunk only: it enters through ``tp_copy``, whose backward sums them. Parameters read
    directly (``get_attr``) are summed after the step instead (``sum_grads``)."""
    g = gm.graph
    grad = grad_flow(gm)
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in list(chunked):
        if meta.TP.get(n) is not None:
            continue  # a collective
        for a in n.all_input_nodes:
            if a in chunked or a.op == "get_attr" or a not in grad or meta.TP.get(a):
                continue
            if a not in copied:
                with g.inserting_after(a):
                    copied[a] = graph.insert(g, collectives.tp_copy, (a,), a, size)
            n.replace_input_with(a, copied[a])


def _exits(gm: torch.fx.GraphModule, v: torch.fx.Node, d: int,
           chunked: dict[torch.fx.Node, int], size: int, gathered: bool) -> None:
    """Give ``v``'s consumers outside the chunked part what they expect: a column linear's
    input the gathered sequence (its ``tp_copy`` becomes ``tp_seq_gather``), anything else
    the replicated value."""
    g = gm.graph
    back: torch.fx.Node | None = None
    gather: torch.fx.Node | None = None
    for user in list(v.users):
        if user in chunked:
            continue
        if _shape_read(user):
            with g.inserting_before(user):
                full = graph.insert(g, collectives.tp_seq_full_shape, (v, d, gathered),
                                    user)
                meta.TENSOR.set(full, None)
                if user.op == "call_method" and len(user.args) > 1:  # x.size(k)
                    full = graph.insert(g, operator.getitem, (full, user.args[1]), user)
                    meta.TENSOR.set(full, None)
            user.replace_all_uses_with(full)
            g.erase_node(user)
            continue
        if meta.TP.get(user) == "tp_copy" and gather is not None:
            nbytes = int(getattr(meta.TENSOR.get(gather), "nbytes", 0) or 0)
            for linear in user.users:  # q, k and v share one gather of the chunk: each
                costs.rename_saved(linear, v.name, gather.name, nbytes)  # saves it, once
            user.replace_all_uses_with(gather)
            g.erase_node(user)
            continue
        if meta.TP.get(user) == "tp_copy":
            gather = user
            user.target = collectives.tp_seq_gather
            user.args = (v, d)
            meta.TP.set(user, "tp_seq_gather")
            full = costs.local_info(meta.TENSOR.get(v), d, size, True)
            meta.TENSOR.set(user, full)
            for linear in user.users:  # it saves the gathered input, not the chunk
                costs.rename_saved(linear, v.name, user.name,
                                   int(getattr(full, "nbytes", 0) or 0))
            continue
        if back is None:
            with g.inserting_after(v):
                back = _insert(gm, collectives.tp_seq_unscatter, v, d, v, size, True)
            if gathered:
                with g.inserting_after(back):
                    back = graph.insert(g, collectives.tp_split_batch, (back,), v,
                                        size)
        user.replace_input_with(v, back)


def _shape_read(n: torch.fx.Node) -> bool:
    return ((n.op == "call_function" and n.target is getattr and n.args[1] == "shape")
            or (n.op == "call_method" and n.target == "size" and not n.kwargs))


__all__ = ["sequence_parallel"]
