"""The context-parallel rewrite of a traced graph: every rank computes its tokens.

The sequence is the symbol of dim 1 of the graph's first input (``torch.export`` keeps it
symbolic). A value is *local* (this rank's tokens along each dim of that length) when it
derives from an input the attention's queries, keys and values or the model's outputs
read; the rest stays *whole*: masks and positions every rank computes from the whole
inputs, which is how positions stay global. Where a whole value meets a local one in an
elementwise op it is cut to the local rows (``cp_localize``); a sequence size a local op
reads becomes the local length; ``scaled_dot_product_attention`` becomes ``cp_sdpa``;
local outputs are gathered back in order (``cp_gather``). An op that would mix tokens
on a chunk (a softmax, a reduction or a matmul over the sequence, attention not written
as SDPA) is refused with the node and the reason: never a silent wrong answer.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from cost_model.errors import SMPPassError
from cost_model.node_cost import NodeCost
from passes import meta
from passes.context_parallel import collectives
from passes.context_parallel.attention import cp_sdpa
from passes.context_parallel.coverage import ContextParallelPlan
from passes.context_parallel.gqa import gather_small, repeat_chain
from passes.graph_utils import copy_graph_module
from passes.tensor_parallel import costs

aten = torch.ops.aten
SDPA = (aten.scaled_dot_product_attention.default,
        torch.nn.functional.scaled_dot_product_attention)
ELEMENTWISE = frozenset({
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.where.self,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, operator.add, operator.mul,
    operator.sub, operator.truediv, torch.add, torch.mul, torch.sub, torch.where})
"""Ops where a whole operand meeting a local one is cut to the local rows."""
DIM_OPS = frozenset({
    aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
    aten.log_softmax.int, aten.cumsum.default, aten.cumprod.default, aten.sort.default,
    aten.topk.default, aten.argmax.default, aten.argmin.default, aten.max.dim,
    aten.min.dim, aten.amax.default, aten.amin.default, aten.sum.dim_IntList,
    aten.mean.dim, aten.logsumexp.default, aten.flip.default, aten.roll.default,
    aten.narrow.default, aten.select.int, aten.index_select.default, aten.gather.default,
    aten.var.correction, aten.std.correction})
"""Ops whose ``dim`` argument (position 1) must not be the sequence of a local value."""
MATMULS = frozenset({aten.matmul.default, aten.bmm.default, aten.mm.default,
                     aten.baddbmm.default, torch.matmul, torch.bmm})
CONVOLUTIONS = frozenset({aten.convolution.default, aten.conv1d.default,
                          aten.conv2d.default})


@dataclass
class _Walk:
    gm: torch.fx.GraphModule
    seq: Any  # the sympy symbol of the sequence length
    local: set[torch.fx.Node]
    refused: list[tuple[str, str]]
    localized: list[str]
    twins: dict[torch.fx.Node, torch.fx.Node]
    bad: set[torch.fx.Node]
    """Refused nodes and what reads them (refused once, at the first)."""
    small_kv: list[str]
    cuts: dict[torch.fx.Node, torch.fx.Node]
    """Grouped-query keys and values gathered before their repeat to the query heads."""


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_tensor(node: Any) -> bool:
    return isinstance(_val(node), torch.Tensor)


def _attention(walk: _Walk, node: torch.fx.Node) -> None:
    """SDPA -> ``cp_sdpa``; a key or value repeated to the query heads is gathered before
    the repeat (``gqa``)."""
    node.target = cp_sdpa
    originals = {twin: whole for whole, twin in walk.twins.items()}
    kwargs = dict(node.kwargs)
    for pos, flag in ((1, "key_whole"), (2, "value_whole")):
        operand = node.args[pos] if len(node.args) > pos else None
        found = repeat_chain(operand) if isinstance(operand, torch.fx.Node) else None
        if found is None or found[1] not in walk.local or seq_dims(found[1], walk.seq) != (
                _val(found[1]).dim() - 2,):
            continue
        gather_small(walk.gm.graph, found[0], found[1], originals, _insert)
        kwargs[flag] = True
        walk.small_kv.append(found[1].name)
    node.kwargs = kwargs


def _is_data(node: Any) -> bool:
    """A tensor, or a tuple of them (an op with several outputs, read by getitem)."""
    val = _val(node)
    return isinstance(val, torch.Tensor) or isinstance(val, (tuple, list)) and any(
        isinstance(v, torch.Tensor) for v in val)


def _is_symint(node: Any) -> bool:
    return isinstance(_val(node), torch.SymInt)


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else None


def _is_seq(size: Any, seq: Any) -> bool:
    """Whether ``size`` is the sequence length wherever the trace allows it: the symbol,
    or an expression of it equal to it over its range (``Min(256, s)`` when s <= 256)."""
    expr = _expr(size)
    if expr is None or expr.free_symbols != {seq}:
        return False
    if expr == seq:
        return True
    bounds = size.node.shape_env.var_to_range.get(seq)
    if bounds is None:
        return False
    lower = max(_finite(bounds.lower) or 2, 2)
    upper = _finite(bounds.upper)
    samples = {lower, lower + 1} | ({upper} if upper is not None else set())
    return all(expr.subs(seq, v) == v for v in samples)


def _finite(bound: Any) -> int | None:
    """An integer bound of a symbol's range; None when unbounded."""
    try:
        value = int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
    return value if abs(value) < 2**62 else None


def seq_dims(node: Any, seq: Any) -> tuple[int, ...]:
    """Dims of ``node``'s tensor whose size is the sequence length."""
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        return ()
    return tuple(i for i, s in enumerate(val.shape) if _is_seq(s, seq))


def _mentions(node: Any, seq: Any) -> bool:
    """Whether any size of ``node``'s value (or the value, a SymInt) involves the sequence."""
    val = _val(node)
    sizes = val.shape if isinstance(val, torch.Tensor) else (val,)
    return any(isinstance(s, torch.SymInt) and seq in s.node.expr.free_symbols for s in sizes)


def sequence_symbol(gm: torch.fx.GraphModule) -> Any:
    """The symbol of dim 1 of the first input; refused when the graph fixed it."""
    first = next((n for n in gm.graph.nodes if n.op == "placeholder"), None)
    val = _val(first)
    if first is None or not isinstance(val, torch.Tensor) or val.dim() < 2 \
            or _expr(val.shape[1]) is None or not _expr(val.shape[1]).is_Symbol:
        raise SMPPassError.build(
            "context parallelism splits dim 1 of the model's first input, which must be a "
            "symbolic sequence length in the traced graph", None if first is None else
            first.name, "passes.context_parallel",
            "pass (batch, sequence, ...) inputs first, to a model torch.export traces "
            "(Hugging Face models are)")
    return _expr(val.shape[1])


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Data inputs of ``node`` (an SDPA's mask excluded: it may stay whole)."""
    ins = [a for a in node.all_input_nodes if _is_data(a)]
    if node.target in SDPA:
        ins = [a for a in ins if a in (node.args[:3])]
    return ins


def _reaching(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes whose data reaches an attention's query/key/value or the output."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    todo = [a for a in output.all_input_nodes if _is_tensor(a)]
    todo += [a for n in gm.graph.nodes if n.target in SDPA for a in _tensor_inputs(n)]
    seen: set[torch.fx.Node] = set()
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += _tensor_inputs(n)
    return seen


def context_parallel(gm: torch.fx.GraphModule, degree: int
                     ) -> tuple[torch.fx.GraphModule, ContextParallelPlan]:
    """The rewritten copy of ``gm`` (the same for every cp rank) and what was done.
    Raises ``SMPPassError`` listing every node it refuses, with the reason."""
    new = copy_graph_module(gm)
    if degree <= 1:
        return new, ContextParallelPlan(degree)
    walk = _Walk(new, sequence_symbol(new), set(), [], [], {}, set(), [], {})
    first_input = next(n for n in new.graph.nodes if n.op == "placeholder")
    traced = meta.TENSOR.get(first_input)
    if traced is not None:  # the traced microbatch's length: refused here, before a step
        collectives.local_index(int(traced.shape[1]), degree, 0)
    reach = _reaching(new)
    graph = new.graph
    split: list[str] = []
    gathered: tuple[str, ...] = ()
    first_local: torch.fx.Node | None = None
    for node in list(graph.nodes):
        if node.op == "placeholder":
            dims = seq_dims(node, walk.seq)
            if dims and node in reach:
                first_local = first_local or _split_input(walk, node, dims, split)
            continue
        if node.op == "output":
            gathered = _gather_outputs(walk, node)
            break
        if node.op != "call_function" or not _is_data(node):
            continue
        if not any(a in walk.local for a in _tensor_inputs(node)):
            if node.target in SDPA and any(a in walk.local for a in node.all_input_nodes):
                walk.refused.append((node.name, "its mask is computed from local tokens"))
            continue
        walk.local.add(node)
        if any(a in walk.bad for a in node.all_input_nodes):
            walk.bad.add(node)
            continue
        refused = len(walk.refused)
        _check(walk, node)
        if len(walk.refused) > refused:
            walk.bad.add(node)
            continue
        _localize_operands(walk, node)
        _local_sizes(walk, node, first_local)
        if node.target in SDPA:
            _attention(walk, node)
    if walk.refused:
        lines = "; ".join(f"{n}: {why}" for n, why in walk.refused)
        raise SMPPassError.build(
            f"context parallelism cannot split {len(walk.refused)} op(s) of this graph by "
            f"sequence: {lines}", degree, "passes.context_parallel",
            "write attention as torch.nn.functional.scaled_dot_product_attention (Hugging "
            "Face: attn_implementation='sdpa'), keep sequence reductions outside the model, "
            "or set context_parallel_degree to 1")
    graph.lint()
    new.recompile()
    _local_costs(walk, degree)
    attention = tuple(n.name for n in graph.nodes if n.target is cp_sdpa)
    return new, ContextParallelPlan(degree, tuple(split), attention, tuple(walk.localized),
                                    gathered, tuple(walk.small_kv))


def _local_costs(walk: _Walk, degree: int) -> None:
    """One rank's costs: a local node's work, output and saved bytes are 1/degree of the
    whole (the keys and values ``cp_sdpa`` gathers and saves are counted local too)."""
    local = {n.name for n in walk.local} - {n.name for n in walk.bad}
    for node in walk.gm.graph.nodes:
        if node.name not in local:
            continue
        cost = meta.COST.get(node)
        if cost is not None:
            meta.COST.set(node, costs.divide(cost, degree))
        dims = seq_dims(node, walk.seq)
        if dims:
            meta.TENSOR.set(node, costs.local_info(meta.TENSOR.get(node), dims[0], degree))
    costs.divide_saved(walk.gm, local, degree)


def _insert(graph: torch.fx.Graph, fn: Any, args: tuple[Any, ...], like: torch.fx.Node,
            stage_of: torch.fx.Node) -> torch.fx.Node:
    """A ``call_function`` node with ``like``'s value, no cost or parameters of its own, on
    ``stage_of``'s pipeline stage."""
    n = graph.call_function(fn, args)
    n.meta = dict(like.meta)
    meta.PARAMS.set(n, ())
    meta.COST.set(n, NodeCost())
    stage = meta.STAGE.get(stage_of) if meta.STAGE.name in stage_of.meta else None
    if stage is not None:
        meta.STAGE.set(n, stage)
    else:
        n.meta.pop(meta.STAGE.name, None)
    return n


def _split_input(walk: _Walk, node: torch.fx.Node, dims: tuple[int, ...],
                 split: list[str]) -> torch.fx.Node:
    graph = walk.gm.graph
    users = list(node.users)
    with graph.inserting_after(node):
        cut = _insert(graph, collectives.cp_split, (node, dims[0]), node, users[0])
    if len(dims) > 1:
        walk.refused.append((node.name, f"input has the sequence length in dims {dims}"))
    for user in users:
        if user.target is not aten.sym_size.int:
            user.replace_input_with(node, cut)
    walk.local.add(cut)
    split.append(node.name)
    return cut


def _check(walk: _Walk, node: torch.fx.Node) -> None:
    """Refuse ``node`` if computing it on local tokens would be wrong."""
    target, seq = node.target, walk.seq
    local_in = [a for a in _tensor_inputs(node) if a in walk.local]
    if target in SDPA:
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, torch.fx.Node) and mask in walk.local:
            walk.refused.append((node.name, "its mask is computed from local tokens"))
        return
    dims = [seq_dims(a, seq) for a in local_in]
    if target in DIM_OPS and len(node.args) > 1:
        dim_arg = node.args[1]
        wanted = dim_arg if isinstance(dim_arg, (list, tuple)) else [dim_arg]
        src = node.args[0]
        rank = _val(src).dim() if _is_tensor(src) else 0
        if any(isinstance(d, int) and rank and d % rank in seq_dims(src, seq) for d in wanted):
            walk.refused.append((node.name, f"{_name(target)} along the sequence of a chunk"))
            return
    if target is aten.slice.Tensor and node.args[0] in walk.local:
        dim = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        rank = _val(node.args[0]).dim()
        whole = start in (0, None) and (end is None or isinstance(end, int) and end >= 2**62)
        if dim % rank in seq_dims(node.args[0], seq) and not whole:
            walk.refused.append((node.name, "a slice of the sequence of a chunk"))
            return
    if target in MATMULS and local_in:
        a = node.args[-2] if target is aten.baddbmm.default else node.args[0]
        if _is_tensor(a) and _val(a).dim() - 1 in seq_dims(a, seq):
            walk.refused.append((node.name, "a matmul contracting the sequence (attention "
                                            "not written as scaled_dot_product_attention)"))
            return
    if target in CONVOLUTIONS and any(d and max(d) >= 2 for d in dims):
        walk.refused.append((node.name, "a convolution along the sequence"))
        return
    if target is aten.cat.default:
        _check_cat(walk, node)
        return
    if _is_tensor(node) and any(dims) and not _mentions(node, seq) \
            and target not in (aten.sym_size.int,):
        walk.refused.append((node.name, f"{_name(target)} reduces over the sequence of a "
                                        "chunk (each rank would hold a partial result)"))
        return
    if len(seq_dims(node, seq)) > 1:
        walk.refused.append((node.name, "holds sequence x sequence values computed from a "
                                        "chunk (attention not written as "
                                        "scaled_dot_product_attention)"))


def _check_cat(walk: _Walk, node: torch.fx.Node) -> None:
    operands: Any = node.args[0]
    parts = [p for p in operands if isinstance(p, torch.fx.Node)]
    dim: Any = node.args[1] if len(node.args) > 1 else 0
    for p in parts:
        val = _val(p)
        if p in walk.local or not isinstance(val, torch.Tensor):
            continue
        empty = val.numel() == 0 if not isinstance(val.numel(), torch.SymInt) else False
        if not empty and val.dim() and dim % val.dim() in seq_dims(node, walk.seq):
            walk.refused.append((node.name, "concatenates whole and local values along "
                                            "the sequence"))
            return


def _localize_operands(walk: _Walk, node: torch.fx.Node) -> None:
    """Whole operands with the sequence length: cut to local rows, or refused."""
    for arg in list(node.all_input_nodes):
        if arg in walk.local or not _is_tensor(arg):
            continue
        dims = seq_dims(arg, walk.seq)
        if not dims or node.target in SDPA:
            continue
        if node.target not in ELEMENTWISE:
            walk.refused.append((node.name, f"{_name(node.target)} reads a whole-sequence "
                                            f"value ({arg.name}) beside local tokens"))
            continue
        if arg not in walk.cuts:  # one cut per whole value, shared by its local readers
            where = walk.gm.graph.inserting_after(arg) if arg.op != "placeholder" \
                else walk.gm.graph.inserting_before(node)
            with where:
                walk.cuts[arg] = _insert(walk.gm.graph, collectives.cp_localize, (arg, dims),
                                         arg, node)
            walk.localized.append(arg.name)
        node.replace_input_with(arg, walk.cuts[arg])


def _local_sizes(walk: _Walk, node: torch.fx.Node, first: torch.fx.Node | None) -> None:
    """Sequence sizes ``node`` reads (views, expands) become the local length."""
    for arg in list(node.all_input_nodes):
        if _is_symint(arg) and walk.seq in _expr(_val(arg)).free_symbols:
            node.replace_input_with(arg, _twin(walk, arg, first))


def _twin(walk: _Walk, size: torch.fx.Node, first: torch.fx.Node | None) -> torch.fx.Node:
    """The node computing ``size`` with the local sequence length for the whole one."""
    if size in walk.twins:
        return walk.twins[size]
    graph = walk.gm.graph
    if size.target is aten.sym_size.int and size.args[0] in walk.local:
        return size
    if size.target is aten.sym_size.int and _expr(_val(size)) == walk.seq and first is not None:
        with graph.inserting_after(first):
            twin = _insert(graph, aten.sym_size.int, (first, 1), size, first)
    elif size.target in (operator.mul, operator.add, operator.sub, operator.floordiv):
        args = [_twin(walk, a, first) if isinstance(a, torch.fx.Node) and _is_symint(a) else a
                for a in size.args]
        with graph.inserting_after(size):
            twin = _insert(graph, size.target, tuple(args), size, size)
    else:
        walk.refused.append((size.name, "a size derived from the sequence length in a way "
                                        "the rewrite cannot follow"))
        return size
    walk.twins[size] = twin
    return twin


def _gather_outputs(walk: _Walk, output: torch.fx.Node) -> tuple[str, ...]:
    graph = walk.gm.graph
    done: list[str] = []
    for arg in list(output.all_input_nodes):
        if arg not in walk.local:
            continue
        dims = seq_dims(arg, walk.seq)
        if len(dims) != 1:
            walk.refused.append((arg.name, "a model output computed from local tokens without "
                                           "one sequence dim to gather along"))
            continue
        with graph.inserting_before(output):
            whole = _insert(graph, collectives.cp_gather, (arg, dims[0]), arg, arg)
        output.replace_input_with(arg, whole)
        done.append(arg.name)
    return tuple(done)


def _name(target: Any) -> str:
    return str(getattr(target, "__name__", target))


def nodes_named(gm: torch.fx.GraphModule, names: Iterable[str]) -> list[torch.fx.Node]:
    wanted = set(names)
    return [n for n in gm.graph.nodes if n.name in wanted]


__all__ = ["context_parallel", "seq_dims", "sequence_symbol"]
