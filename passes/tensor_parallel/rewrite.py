"""``tensor_parallel``: shard the linears of marked modules across the tensor-parallel group.

Linears pair Megatron-style (column-parallel into row-parallel through ops the rules
carry a split through); an unpaired one is lone (column, output gathered). Every rank's
graph has the same nodes, names and stages, holding its own shards under the original
names. See docs/tensor_parallel.md, 'The rewrite'.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from passes import meta
from passes.graph_utils import copy_graph_module
from passes.tensor_parallel import analysis, collectives, costs, graph, loss, vocab
from passes.tensor_parallel.linears import Linear, sharded_node
from passes.tensor_parallel.plan import ShardSpec, TensorParallelPlan, merge_shards
from passes.tensor_parallel.propagation import ArgPos
from passes.tensor_parallel.reshapes import local_sizes
from passes.tensor_parallel.sequence import sequence_parallel


@dataclass(frozen=True)
class TensorParallelism:
    """The rewrite's inputs: degree, this rank, batch semantics, marked module paths."""

    size: int
    rank: int
    prescaled_batch: bool = False
    marked: tuple[str, ...] = ()
    sequence_parallel: bool = False
    """``optimize: "memory"``: chunk the activations between pairs by sequence
    (``passes.tensor_parallel.sequence``)."""
    cutting: Callable[[], AbstractContextManager[object]] = field(default=nullcontext,
                                                                  compare=False)
    """A context around cutting the shards from the full parameters (delayed
    initialisation records the cut there, so a meta shard is rebuilt as its slice); not
    part of what the rewrite computes, so not compared."""


def opaque_leaves(gm: torch.fx.GraphModule, marked: Sequence[str]) -> list[tuple[str, str]]:
    """The marked modules the fx front end kept whole (``smp.auto_leaves``: their forward
    could not be traced symbolically, and torch.export did not take the model): the
    rewrite cannot see the linears inside them, so each stays replicated, said with why."""
    out = []
    for path in gm.meta.get("smp.auto_leaves", ()):
        if not any(analysis.in_region(path, r) for r in marked):
            continue
        inner = [n for n, m in gm.get_submodule(path).named_modules()
                 if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
        if inner:
            out.append((path, f"traced as one opaque module (fx cannot trace its forward "
                        f"and torch.export did not take the model), so its {len(inner)} "
                        "linear or embedding modules are not seen; make its forward "
                        "traceable (e.g. another attention implementation) or the model "
                        "exportable"))
    return out


def tensor_parallel(gm: torch.fx.GraphModule, tp: TensorParallelism,
                    comm_time: costs.CommTime | None = None
                    ) -> tuple[torch.fx.GraphModule, TensorParallelPlan]:
    """The rewritten copy of ``gm`` for ``tp.rank`` and the plan (module docstring).

    The copy's costs are one rank's (``passes.tensor_parallel.costs``): split work divided by the
    degree, each collective priced by ``comm_time(nbytes)`` (the link model; None: free)."""
    new = copy_graph_module(gm)
    if tp.size <= 1 or not tp.marked:
        return new, TensorParallelPlan(tp.size)
    by_name = {n.name: n for n in new.graph.nodes}
    sharded: list[ShardSpec] = []
    replicated: list[tuple[str, str]] = []
    pairs: list[tuple[str, str]] = []
    ties: graph.Ties = {}
    vocab_embeds: list[vocab.Embedding] = []
    done: list[str] = []
    held_part: list[str] = []  # nodes whose output each rank holds 1/tp of
    lone: list[tuple[str, str]] = []
    replicated += opaque_leaves(new, tp.marked)
    for region in analysis.tied_regions(new, analysis.regions(tp.marked)):
        found = analysis.analyse(new, region, tp.size, tp.prescaled_batch)
        replicated += found.replicated
        lone += found.lone
        linears, embeds, split, rw = found.linears, found.embeds, found.split, found.rw
        if not linears and not embeds:
            continue
        done += region
        vocab_embeds += embeds
        for emb in embeds:
            with tp.cutting():
                sharded.append(vocab.rewrite(new, by_name[emb.node.name], emb, tp.size,
                                             tp.rank, not tp.prescaled_batch, ties))
        for node, pos in rw.divide:
            _scale_arg(new.graph, node, pos, operator.floordiv, tp.size)
        for node, pos in rw.batch if not tp.prescaled_batch else ():
            _scale_arg(new.graph, node, pos, operator.mul, tp.size)
        for node in rw.runtime:
            sizes = node.args[1]
            with new.graph.inserting_before(node):
                local = graph.insert(new.graph, local_sizes, (sizes, tp.size), node)
            meta.TENSOR.set(local, None)
            graph.computed_val(local)
            node.update_arg(1, local)
        graph.gather_operands(new.graph, rw.gather if not tp.prescaled_batch else [], tp.size)
        graph.copy_operands(new.graph, rw.copies, tp.size)
        graph.scatter_operands(new.graph, rw.slices, tp.size)
        graph.complete_partials(new.graph, rw.partial, tp.size)
        for name, dim in split.items():
            node = by_name[name]
            cost = meta.COST.get(node)
            if cost is not None:
                meta.COST.set(node, costs.divide(cost, tp.size))
            meta.TENSOR.set(node, costs.local_info(meta.TENSOR.get(node), dim, tp.size))
            meta.TP_SPLIT.set(node, dim)
        pairs += analysis.pairs(linears, set(split))  # before the linears' nodes are replaced
        held_part += [*split, *(lin.node.name for lin in linears if lin.role != "row")]
        for lin in linears:
            with tp.cutting():
                sharded += _rewrite(new, by_name[lin.node.name], lin, tp, ties,
                                    rw.strided.get(lin.node.name, 1))
    chunked_params: tuple[str, ...] = ()
    if tp.sequence_parallel and done:
        chunked_params, chunked = sequence_parallel(
            new, analysis.region_test(tuple(done)), tp.size, not tp.prescaled_batch)
        held_part += chunked
    costs.divide_saved(new, set(held_part), tp.size)
    vocab_shards = [s for s in sharded if any(s.name == e.weight for e in vocab_embeds)]
    loss.fuse(new, tp.size, not tp.prescaled_batch,
              loss.vocab_heads(new, vocab_shards, tp.rank))  # a loss of the vocab logits
    costs.price_collectives(new, tp.size, comm_time)
    graph.retie(new, ties)
    graph.mark_gathered(new.graph)
    sharded = _with_aliases(new, sharded)
    new.graph.lint()
    new.recompile()
    return new, TensorParallelPlan(tp.size, tuple(sharded), tuple(replicated), tuple(pairs),
                                   chunked_params, tuple(lone), _elements(gm, sharded))


def _elements(gm: torch.fx.GraphModule, sharded: Sequence[ShardSpec]) -> tuple[int, int]:
    """(parameter elements sharded, all parameter elements) of the model, each tensor
    counted once (tied names share one)."""
    total = {id(p): p.numel() for p in gm.parameters()}
    done = {id(graph.attr(gm, s.name)) for s in sharded}
    return sum(n for t, n in total.items() if t in done), sum(total.values())


def _with_aliases(gm: torch.fx.GraphModule, sharded: Sequence[ShardSpec]) -> list[ShardSpec]:
    """One spec per name: a shard tied under several names (torch.export reads HF GPT-2's
    tied ``wte`` through ``lm_head.weight``) gets a spec under each, so the runtime finds
    it under whichever name ``named_parameters()`` keeps."""
    names: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out: dict[str, ShardSpec] = {}
    for spec in sharded:
        for name in [spec.name, *names.get(id(graph.attr(gm, spec.name)), [])]:
            out.setdefault(name, dataclasses.replace(spec, name=name))
    return list(out.values())


def _scale_arg(g: torch.fx.Graph, node: torch.fx.Node, pos: ArgPos,
               op: Callable[[Any, int], Any], size: int) -> None:
    """Turn a size argument of ``node`` into this rank's: a global feature size
    ``// tp``, a local batch size ``* tp`` (the batch gathered over the tp group)."""
    if isinstance(pos, tuple):
        value = node.args[pos[0]][pos[1]]  # type: ignore[index]
    else:
        value = node.args[pos] if isinstance(pos, int) else node.kwargs[pos]
    if isinstance(value, torch.fx.Node):
        with g.inserting_before(node):
            value = graph.insert(g, op, (value, size), node)
            meta.TENSOR.set(value, None)
    else:
        value = op(value, size)
    if isinstance(pos, tuple):
        sizes = list(node.args[pos[0]])  # type: ignore[arg-type]
        sizes[pos[1]] = value
        node.update_arg(pos[0], sizes)
    elif isinstance(pos, int):
        node.update_arg(pos, value)
    else:
        node.update_kwarg(pos, value)


def _rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node, lin: Linear,
             tp: TensorParallelism, ties: graph.Ties, stride: int = 1) -> list[ShardSpec]:
    """Replace ``node`` by its sharded form; the shard specs of its parameters."""
    size, rank, g = tp.size, tp.rank, gm.graph
    w_full, b_full = lin.weight_value, lin.bias_value
    if node.op == "call_module":
        graph.replace_module(gm, str(node.target))
    w_dim = lin.weight_dim()
    # a lone LM head tied to a padded vocab-parallel embedding: its rows are padded too
    pad = 0 if lin.role == "row" else vocab.padding(lin.out_features, size)
    graph.set_param(gm, lin.weight, graph.shard(graph.pad(w_full, w_dim, pad), w_dim,
                                                size, rank, stride),
                    original=w_full, ties=ties)
    specs = [ShardSpec(lin.weight, w_dim, size, tuple(w_full.shape), stride, pad)]
    if lin.bias is not None and b_full is not None:  # ties: a bias read under two names
        if lin.role == "row":  # (BERT's decoder.bias and predictions.bias) stays one tensor
            graph.set_param(gm, lin.bias, b_full.detach().clone(), original=b_full, ties=ties)
        else:
            graph.set_param(gm, lin.bias, graph.shard(graph.pad(b_full, 0, pad), 0, size,
                                                      rank, stride),
                            original=b_full, ties=ties)
            specs.append(ShardSpec(lin.bias, 0, size, tuple(b_full.shape), stride, pad))
    x = node.args[lin.x_pos]
    assert isinstance(x, torch.fx.Node)
    gather = not tp.prescaled_batch
    with g.inserting_before(node):
        if lin.role != "row":
            if gather:
                x = graph.insert(g, collectives.tp_gather_batch, (x,), node, size)
            x = graph.insert(g, collectives.tp_copy, (x,), node, size)
        w = graph.get_attr(g, lin.weight, node)
        b = None
        if lin.bias is not None and lin.role != "row":
            b = graph.get_attr(g, lin.bias, node)
        y = sharded_node(g, lin, x, w, b)
        y.meta = dict(node.meta)
        cost = meta.COST.get(node)
        if cost is not None:
            cost = costs.divide(cost, size, params=True)
            meta.COST.set(y, cost if not pad else dataclasses.replace(  # the padded shard
                cost, param_bytes=cost.param_bytes * (lin.out_features + pad)
                // lin.out_features))
        if meta.GEMM.has(node):
            meta.GEMM.set(y, costs.shard_gemm(meta.GEMM.get(node), lin.role == "row", size))
        if lin.role != "row":  # a row linear's partial sums have the full shape
            meta.TENSOR.set(y, costs.local_info(meta.TENSOR.get(node), -1, size))
            meta.TP_SPLIT.set(y, -1)
        meta.TP.set(y, lin.role)
        meta.PARAMS.set(y, tuple(str(a.target) for a in (w, b) if a is not None))
    with g.inserting_after(y):
        out = y
        if lin.role == "row":
            out = graph.insert(g, collectives.tp_reduce, (out,), node, size)
            if lin.bias is not None:
                with g.inserting_after(out):
                    b = graph.get_attr(g, lin.bias, node)
                with g.inserting_after(b):
                    out = graph.insert(g, operator.add, (out, b), node, size)
        elif lin.role == "lone":
            out = graph.insert(g, collectives.tp_gather_last,
                               (out, lin.out_features) if pad else (out,), node, size)
            if pad:  # sliced back to the vocabulary
                meta.TENSOR.set(out, meta.TENSOR.get(node))
        if gather and lin.role != "col":
            with g.inserting_after(out):
                out = graph.insert(g, collectives.tp_split_batch, (out,), node, size)
    graph.replace_node(g, node, out, lin.views)
    return specs


__all__ = ["ShardSpec", "TensorParallelPlan", "TensorParallelism", "merge_shards",
           "tensor_parallel"]
