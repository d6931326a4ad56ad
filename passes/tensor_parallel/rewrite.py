"""``tensor_parallel``: shard the linears of marked modules across the tensor-parallel group.

For every marked region (an outermost module marked by ``smp.tensor_parallelism``,
``smp.set_tensor_parallelism`` or an ``smp.nn`` type; given as module paths), the pass
finds the linears (``nn.Linear`` leaves, ``F.linear`` / ``aten.linear`` on parameters)
and pairs them Megatron-style:

* a *column-parallel* linear (weight rows split: each rank computes ``out/tp`` features)
  whose output flows through ops the sharding rules of ``passes.tensor_parallel.rules`` carry a
  split through (element-wise ops, SwiGLU's ``gate * up``, attention's views into heads,
  transposes, softmax, sdpa; a fused q/k/v ``split`` makes the linear strided) into
* a *row-parallel* linear (weight columns split) whose partial sums are all-reduced, then
  its bias is added once.

A linear whose output no rule carries to another linear is a lone linear
with ``smp.nn.DistributedLinear``'s semantics: column-parallel, its output all-gathered
along the features. Collectives are ``call_function`` nodes of
``passes.tensor_parallel.collectives``.
With ``prescaled_batch`` false each pair (and each lone linear) gathers its input over the
tp group's batches and keeps this rank's part of the output.

A region the pass cannot shard (sizes not divisible by tp, a split value reaching an op
with no rule, no linear at all) stays replicated, and
``TensorParallelPlan.replicated`` says why. The result depends on ``rank``: each rank's
graph holds its own shards, under the original parameter names; every rank's graph has
the same nodes, names and stages.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from passes import meta
from passes.graph_utils import copy_graph_module
from passes.tensor_parallel import collectives, costs, graph, loss, sweep, vocab
from passes.tensor_parallel.linears import Linear, as_linear, sharded_node
from passes.tensor_parallel.plan import ShardSpec, TensorParallelPlan, merge_shards
from passes.tensor_parallel.propagation import ArgPos, Rewrites
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




def _in_region(path: str, region: str) -> bool:
    return region == "" or path == region or path.startswith(region + ".")


def _region_test(region: tuple[str, ...]) -> Callable[[torch.fx.Node], bool]:
    def inside(n: torch.fx.Node) -> bool:
        return any(_in_region(meta.MODULE_PATH.get(n, ""), r) for r in region)
    return inside


def regions(marked: Sequence[str]) -> list[tuple[str, ...]]:
    """The outermost marked paths, siblings grouped (modules created together inside one
    ``smp.tensor_parallelism`` context form one region)."""
    outer = sorted({r for r in marked if not any(r != o and _in_region(r, o) for o in marked)})
    groups: dict[str, list[str]] = {}
    for path in outer:
        groups.setdefault(path.rpartition(".")[0] if path else "\0", []).append(path)
    return [tuple(g) for _, g in sorted(groups.items())]


def tied_regions(gm: torch.fx.GraphModule, groups: Sequence[tuple[str, ...]]
                 ) -> list[tuple[str, ...]]:
    """``groups`` with the regions that hold one tensor merged: a tied LM head and its
    embedding marked apart (HF GPT-2's ``lm_head`` and ``transformer.wte`` are not
    siblings) share one shard, so they are sharded together or not at all."""
    params = list(gm.named_parameters(remove_duplicate=False))
    out: list[tuple[tuple[str, ...], set[int]]] = []
    for region in groups:
        ids = {id(p) for name, p in params
               if any(_in_region(name.rpartition(".")[0], r) for r in region)}
        for i in [i for i, (_, held) in enumerate(out) if held & ids][::-1]:
            merged, held = out.pop(i)
            region, ids = tuple(sorted({*merged, *region})), ids | held
        out.append((region, ids))
    return [region for region, _ in out]


def _analyse(gm: torch.fx.GraphModule, region: tuple[str, ...], size: int,
             embeds: Sequence[vocab.Embedding] = (), prescaled: bool = True
             ) -> tuple[list[Linear], str | None, dict[str, int], Rewrites]:
    """The region's linears with their roles, or a reason to leave it replicated; the
    nodes that carry a split value with its dim (their work is split too); the shape
    edits. A column linear whose output no rule carries on is a lone linear.
    ``embeds``: the region's embeddings, split by rows (``passes.tensor_parallel.vocab``)."""
    nodes = list(gm.graph.nodes)  # element-wise ops between the linears may lie outside
    linears = {n: lin for n in nodes
               if any(_in_region(meta.MODULE_PATH.get(n, ""), r) for r in region)
               and (lin := as_linear(gm, n)) is not None}
    for emb in embeds:
        why = vocab.reason(emb, size)
        if why is not None:
            return [], why, {}, Rewrites()
    shared = _shared_weight(gm, linears, embeds)  # an embedding alone too (HF's wte)
    if shared is not None:
        return [], shared, {}, Rewrites()
    if not linears:
        return [], None if embeds else "no linear layer to shard", {}, Rewrites()
    weights = [id(lin.weight_value) for lin in linears.values()]
    if len(set(weights)) != len(weights):
        return [], "a linear weight is shared by several layers", {}, Rewrites()
    lone: set[torch.fx.Node] = set()
    while True:
        split, rw, reason, culprit = sweep.sweep(gm, linears, lone, size)
        if culprit is None or culprit in lone:
            break
        lone.add(culprit)
    if reason is not None:
        return [], reason, {}, rw
    if rw.batch_reads and not prescaled:
        return [], (f"{rw.batch_reads[0].name} reads the batch size of a split value at run "
                    "time, which prescaled_batch false gathers (trace with torch.export, or "
                    "set prescaled_batch true)"), {}, rw
    rows_split = {id(e.value) for e in embeds}
    for lin in linears.values():
        if id(lin.weight_value) in rows_split and lin.role != "row":
            if lin.role == "col" and vocab.padding(lin.out_features, size):
                return [], (f"{lin.weight} is tied to a padded vocab-parallel embedding but "
                            "its logits feed a row-parallel linear (padding columns)"), {}, rw
            continue  # split by the embedding's (padded) rows
        dim_size = lin.in_features if lin.role == "row" else lin.out_features
        parts = size * rw.strided.get(lin.node.name, 1)
        if dim_size % parts:
            return [], (f"{lin.weight} has {dim_size} {'in' if lin.role == 'row' else 'out'}"
                        f" features, not divisible by tensor_parallel_degree {size}"
                        + (f" x {parts // size} fused blocks" if parts != size else "")
                        ), {}, rw
    for lin in linears.values():
        if id(lin.weight_value) in rows_split and lin.role == "row":
            return [], (f"{lin.weight} is tied to a vocab-parallel embedding but would be "
                        "split by columns (row-parallel)"), {}, rw
    return (list(linears.values()), None,
            {n.name: d.dim for n, d in split.items() if n not in linears}, rw)


def _pairs(linears: Sequence[Linear], split: set[str]) -> list[tuple[str, str]]:
    """(column, row) module paths: each row linear with the column linears whose output
    reaches it through the element-wise chain between them."""
    cols = [lin for lin in linears if lin.role == "col"]  # graph order
    out = []
    for row in (lin for lin in linears if lin.role == "row"):
        seen: set[str] = set()
        todo = list(row.node.all_input_nodes)
        while todo:
            n = todo.pop()
            if n.name not in seen:
                seen.add(n.name)
                if n.name in split:
                    todo.extend(n.all_input_nodes)
        out += [(c.weight.rpartition(".")[0], row.weight.rpartition(".")[0])
                for c in cols if c.node.name in seen]
    return out


def _shared_weight(gm: torch.fx.GraphModule, linears: Mapping[torch.fx.Node, Linear],
                   embeds: Sequence[vocab.Embedding] = ()) -> str | None:
    """Why the region cannot be sharded when a tensor it would shard is also read by a
    node it does not rewrite (an unmarked tied module, a second use): sharding would untie
    them. A linear tied to one of the region's embeddings is fine (they share the shard)."""
    mine = {id(t): lin.weight.rpartition(".")[0] for lin in linears.values()
            for t in (lin.weight_value, lin.bias_value) if t is not None}
    mine.update({id(e.value): e.weight.rpartition(".")[0] for e in embeds})
    rewritten = set(linears) | {e.node for e in embeds}
    for n in gm.graph.nodes:
        if n in rewritten or (n.op == "get_attr" and all(u in rewritten for u in n.users)):
            continue  # a rewritten node itself, or a get_attr feeding only those (or none)
        for name in meta.PARAMS.get(n, ()) or ():
            try:
                t = graph.attr(gm, name)
            except AttributeError:
                continue
            owner = mine.get(id(t))
            if owner is not None:
                return (f"the weight of {owner} is shared with {n.name} (reads {name}): "
                        "sharding would untie them")
    return None


def tensor_parallel(gm: torch.fx.GraphModule, tp: TensorParallelism,
                    comm_time: costs.CommTime | None = None
                    ) -> tuple[torch.fx.GraphModule, TensorParallelPlan]:
    """The rewritten copy of ``gm`` for ``tp.rank`` and the plan (module docstring).

    The copy's costs are one rank's (``passes.tensor_parallel.costs``): split work divided by the
    degree, each collective priced by ``comm_time(nbytes)`` (the link model; None: free).
    """
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
    for region in tied_regions(new, regions(tp.marked)):
        embeds = vocab.find(new, _region_test(region))
        linears, reason, split, rw = _analyse(new, region, tp.size, embeds, tp.prescaled_batch)
        if reason is not None:
            replicated.append((",".join(region), reason))
            continue
        done += region
        vocab_embeds += embeds
        for emb in embeds:
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
            node.update_arg(1, local)
        graph.gather_operands(new.graph, rw.gather if not tp.prescaled_batch else [], tp.size)
        graph.scatter_operands(new.graph, rw.slices, tp.size)
        for name, dim in split.items():
            node = by_name[name]
            cost = meta.COST.get(node)
            if cost is not None:
                meta.COST.set(node, costs.divide(cost, tp.size))
            meta.TENSOR.set(node, costs.local_info(meta.TENSOR.get(node), dim, tp.size))
            meta.TP_SPLIT.set(node, dim)
        pairs += _pairs(linears, set(split))  # before the rewrite replaces the linears' nodes
        held_part += [*split, *(lin.node.name for lin in linears if lin.role != "row")]
        for lin in linears:
            sharded += _rewrite(new, by_name[lin.node.name], lin, tp, ties,
                                rw.strided.get(lin.node.name, 1))
    chunked_params: tuple[str, ...] = ()
    if tp.sequence_parallel and done:
        chunked_params, chunked = sequence_parallel(new, _region_test(tuple(done)), tp.size,
                                                    not tp.prescaled_batch)
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
                                   chunked_params)


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
    if lin.bias is not None and b_full is not None:
        if lin.role == "row":
            graph.set_param(gm, lin.bias, b_full.detach().clone())
        else:
            graph.set_param(gm, lin.bias, graph.shard(graph.pad(b_full, 0, pad), 0,
                                                      size, rank, stride))
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
    graph.replace_node(g, node, out)
    return specs


__all__ = ["ShardSpec", "TensorParallelPlan", "TensorParallelism", "merge_shards", "regions",
           "tensor_parallel"]
