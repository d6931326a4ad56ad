"""The context-parallel rewrite of a traced graph: every rank computes its tokens.

The sequence is the symbol of dim 1 of the graph's first input (``torch.export`` keeps it
symbolic). A value is *local* (this rank's tokens along each dim of that length) when it
derives from an input the attention's queries, keys and values or the model's outputs
read; the rest stays *whole*: masks and positions every rank computes from the whole
inputs, which is how positions stay global. Where a whole value meets a local one in an
elementwise op it is cut to the local rows (``cp_localize``); a sequence size a local op
reads becomes the local length; ``scaled_dot_product_attention`` becomes ``cp_sdpa``;
local outputs are gathered back in order (``cp_gather``), or kept local when asked; a
cross-entropy inside the model becomes ``cp_loss`` (``loss``). An op that would mix tokens
on a chunk (a softmax, a reduction or a matmul over the sequence, attention not written
as SDPA) is refused with the node and the reason: never a silent wrong answer.
"""

from __future__ import annotations

import logging
import operator
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
from passes.context_parallel.dims import (
    SDPA,
    expr_of,
    is_data,
    is_symint,
    is_tensor,
    mentions,
    name_of,
    seq_dims,
    sequence_symbol,
    tensor_inputs,
    val_of,
)
from passes.context_parallel.gqa import gather_small, repeat_chain
from passes.context_parallel.loss import (
    LOSSES,
    cp_loss,
    loss_targets,
    pad_shifted_labels,
    target_cut,
)
from passes.context_parallel.refusals import DIM_OPS, refusal
from passes.graph_utils import copy_graph_module
from passes.tensor_parallel import costs

log = logging.getLogger("smp_fx.passes.context_parallel")
aten = torch.ops.aten
ELEMENTWISE = frozenset({
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.where.self,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, operator.add, operator.mul,
    operator.sub, operator.truediv, torch.add, torch.mul, torch.sub, torch.where})
"""Ops where a whole operand meeting a local one is cut to the local rows."""


@dataclass
class _Walk:
    """The rewrite's state as it walks the graph once, in order."""

    gm: torch.fx.GraphModule
    seq: Any  # the sympy symbol of the sequence length
    local: set[torch.fx.Node]
    refused: list[tuple[str, str]]
    localized: list[str]
    twins: dict[torch.fx.Node, torch.fx.Node]
    """A size of the whole length -> the node computing it with the local length."""
    bad: set[torch.fx.Node]
    """Refused nodes and what reads them (refused once, at the first)."""
    small_kv: list[str]
    """Grouped-query keys and values gathered before their repeat to the query heads."""
    cuts: dict[torch.fx.Node, torch.fx.Node]
    """A whole value -> its local rows (one cut shared by its local readers)."""
    losses: list[torch.fx.Node]
    """Losses over the local tokens, reduced over cp (``cp_loss``)."""


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
                val_of(found[1]).dim() - 2,):
            continue
        gather_small(walk.gm.graph, found[0], found[1], originals, _insert)
        kwargs[flag] = True
        walk.small_kv.append(found[1].name)
    node.kwargs = kwargs


def _loss(walk: _Walk, node: torch.fx.Node) -> None:
    """A loss over local scores -> ``cp_loss``, its whole targets cut to the local rows."""
    found = target_cut(node, walk.local, walk.seq)
    if isinstance(found, str):
        walk.refused.append((node.name, found))
        walk.bad.add(node)
        return
    labels, reader = found
    with walk.gm.graph.inserting_before(reader):
        cut = _insert(walk.gm.graph, collectives.cp_localize, (labels, (1,)), labels, reader)
    walk.local.add(cut)
    reader.replace_input_with(labels, cut)
    walk.localized.append(labels.name)
    op: Any = node.target
    node.args = (op, *node.args)
    node.target = cp_loss
    walk.losses.append(node)


def _reaching(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes whose data reaches an attention's query/key/value or the output."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    todo = [a for a in output.all_input_nodes if is_tensor(a)]
    todo += [a for n in gm.graph.nodes if n.target in SDPA for a in tensor_inputs(n)]
    seen: set[torch.fx.Node] = set()
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += tensor_inputs(n)
    return seen


def _drop_unread(graph: torch.fx.Graph, reach: set[torch.fx.Node]) -> None:
    """Erase pure ops whose values nothing reads (a key/value cache the forward fills and
    does not return): on a chunk they would be refused, though they change no result."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node not in reach and not node.users \
                and not node.is_impure():
            graph.erase_node(node)


def context_parallel(gm: torch.fx.GraphModule, degree: int, local_outputs: bool = False
                     ) -> tuple[torch.fx.GraphModule, ContextParallelPlan]:
    """The rewritten copy of ``gm`` (the same for every cp rank) and what was done;
    ``local_outputs``: the outputs stay the rank's tokens (not gathered).
    Raises ``SMPPassError`` listing every node it refuses, with the reason."""
    new = copy_graph_module(gm)
    if degree <= 1:
        return new, ContextParallelPlan(degree)
    walk = _Walk(new, sequence_symbol(new), set(), [], [], {}, set(), [], {}, [])
    first_input = next(n for n in new.graph.nodes if n.op == "placeholder")
    traced = meta.TENSOR.get(first_input)
    if traced is not None:  # the traced microbatch's length: refused here, before a step
        collectives.local_index(int(traced.shape[1]), degree, 0)
    pad_shifted_labels(new)
    reach = _reaching(new)
    graph = new.graph
    _drop_unread(graph, reach)
    targets = loss_targets(new)
    split: list[str] = []
    gathered: tuple[str, ...] = ()
    first_local: torch.fx.Node | None = None
    for node in list(graph.nodes):
        if node.op == "placeholder":
            dims = seq_dims(node, walk.seq)
            if dims and node in reach and node not in targets:
                first_local = first_local or _split_input(walk, node, dims, split)
            continue
        if node.op == "output":
            gathered = _gather_outputs(walk, node, local_outputs)
            break
        if node.op != "call_function" or not is_data(node):
            continue
        if not any(a in walk.local for a in tensor_inputs(node)):
            if node.target in SDPA and any(a in walk.local for a in node.all_input_nodes):
                walk.refused.append((node.name, "its mask is computed from local tokens"))
            if _of_flat_tokens(walk, node):
                walk.local.add(node)
                _local_sizes(walk, node, first_local)
            continue
        if any(a in walk.bad for a in node.all_input_nodes):
            walk.local.add(node)
            walk.bad.add(node)
            continue
        if node.target in LOSSES:  # its value is the whole sequence's loss, not local
            _loss(walk, node)
            continue
        walk.local.add(node)
        why = refusal(node, walk.local, walk.seq)
        if why is not None:
            walk.refused.append((node.name, why))
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
    kept = _local_outputs(walk) if local_outputs else ()
    return new, ContextParallelPlan(degree, tuple(split), attention, tuple(walk.localized),
                                    gathered, tuple(walk.small_kv),
                                    tuple(n.name for n in walk.losses), kept)


def _local_costs(walk: _Walk, degree: int) -> None:
    """One rank's costs: a local node's work, output and saved bytes are 1/degree of the
    whole (the keys and values ``cp_sdpa`` gathers and saves are counted local too)."""
    local = {n.name for n in (*walk.local, *walk.losses)} - {n.name for n in walk.bad}
    for node in walk.gm.graph.nodes:
        if node.name not in local:
            continue
        cost = meta.COST.get(node)
        if cost is not None:
            meta.COST.set(node, costs.divide(cost, degree))
        dims = seq_dims(node, walk.seq)
        if dims:
            meta.TENSOR.set(node, costs.local_info(meta.TENSOR.get(node), dims[0], degree))
            meta.CP_LOCAL.set(node, dims)
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


def _position_readers(node: torch.fx.Node, seq: Any) -> set[torch.fx.Node]:
    """Readers of input ``node`` that compute positions from it: a path of ops reading no
    parameter or buffer leads from the reader to a cumulative or other sequence-mixing op
    (RoBERTa numbers the non-padding tokens with a ``cumsum`` over the input ids). They
    read the whole input, so the positions stay global; what they compute meets the local
    tokens through ``cp_localize`` as any whole value does. Empty when every reader would
    stay whole: the tokens must be split somewhere."""
    keep: set[torch.fx.Node] = set()
    for user in node.users:
        cone, todo = {node}, [user]
        while todo and user not in keep:
            n = todo.pop()
            if n in cone or n.op != "call_function" or meta.PARAMS.get(n, ()) or any(
                    a.op == "get_attr" for a in n.all_input_nodes):
                continue
            cone.add(n)
            if n.target in DIM_OPS and refusal(n, cone, seq) is not None:
                keep.add(user)
            todo += list(n.users)
    readers = [u for u in node.users if u.target is not aten.sym_size.int]
    return keep if len(keep) < len(readers) else set()


def _split_input(walk: _Walk, node: torch.fx.Node, dims: tuple[int, ...],
                 split: list[str]) -> torch.fx.Node:
    graph = walk.gm.graph
    users = list(node.users)
    whole = _position_readers(node, walk.seq)
    with graph.inserting_after(node):
        cut = _insert(graph, collectives.cp_split, (node, dims[0]), node, users[0])
    if len(dims) > 1:
        walk.refused.append((node.name, f"input has the sequence length in dims {dims}"))
    for user in users:
        if user in whole:
            log.info("context parallelism: %s reads the whole %s (positions computed from "
                     "the tokens)", user.name, node.name)
        elif user.target is not aten.sym_size.int:
            user.replace_input_with(node, cut)
    walk.local.add(cut)
    split.append(node.name)
    return cut


def _localize_operands(walk: _Walk, node: torch.fx.Node) -> None:
    """Whole operands with the sequence length: cut to local rows, or refused."""
    for arg in list(node.all_input_nodes):
        if arg in walk.local or not is_tensor(arg):
            continue
        dims = seq_dims(arg, walk.seq)
        if not dims or node.target in SDPA:
            continue
        if node.target not in ELEMENTWISE:
            walk.refused.append((node.name, f"{name_of(node.target)} reads a whole-sequence "
                                            f"value ({arg.name}) beside local tokens"))
            continue
        if arg not in walk.cuts:  # one cut per whole value, shared by its local readers
            where = walk.gm.graph.inserting_after(arg) if arg.op != "placeholder" \
                else walk.gm.graph.inserting_before(node)
            with where:
                walk.cuts[arg] = _insert(walk.gm.graph, collectives.cp_localize, (arg, dims),
                                         arg, node)
            walk.local.add(walk.cuts[arg])  # its rows are local: so its shape, if sent
            walk.localized.append(arg.name)
        node.replace_input_with(arg, walk.cuts[arg])


def _of_flat_tokens(walk: _Walk, node: torch.fx.Node) -> bool:
    """Whether ``node`` creates a value over the flattened tokens from sizes alone (no
    tensor read): Mixtral numbers its batch x length x top-k routed tokens with an
    ``arange``. No dim is the length, so no cut could make it local afterwards; it is built
    at the local length, as the tokens it numbers are."""
    return is_tensor(node) and not tensor_inputs(node) and mentions(node, walk.seq) \
        and not seq_dims(node, walk.seq)


def _local_sizes(walk: _Walk, node: torch.fx.Node, first: torch.fx.Node | None) -> None:
    """Sequence sizes ``node`` reads (views, expands) become the local length."""
    for arg in list(node.all_input_nodes):
        if is_symint(arg) and walk.seq in expr_of(val_of(arg)).free_symbols:
            node.replace_input_with(arg, _twin(walk, arg, first))


def _twin(walk: _Walk, size: torch.fx.Node, first: torch.fx.Node | None) -> torch.fx.Node:
    """The node computing ``size`` with the local sequence length for the whole one."""
    if size in walk.twins:
        return walk.twins[size]
    if walk.seq not in expr_of(val_of(size)).free_symbols:  # the batch in batch x length
        return size
    graph = walk.gm.graph
    if size.target is aten.sym_size.int and size.args[0] in walk.local:
        return size
    whole_length = expr_of(val_of(size)) == walk.seq
    if size.target is aten.sym_size.int and whole_length and first is not None:
        with graph.inserting_after(first):
            twin = _insert(graph, aten.sym_size.int, (first, 1), size, first)
    elif size.target in (operator.mul, operator.add, operator.sub, operator.floordiv):
        args = [_twin(walk, a, first) if isinstance(a, torch.fx.Node) and is_symint(a) else a
                for a in size.args]
        with graph.inserting_after(size):
            twin = _insert(graph, size.target, tuple(args), size, size)
    else:
        walk.refused.append((size.name, "a size derived from the sequence length in a way "
                                        "the rewrite cannot follow"))
        return size
    walk.twins[size] = twin
    return twin


def _local_outputs(walk: _Walk) -> tuple[str, ...]:
    output = next(n for n in reversed(walk.gm.graph.nodes) if n.op == "output")
    return tuple(a.name for a in output.all_input_nodes if a in walk.local)


def _gather_outputs(walk: _Walk, output: torch.fx.Node, local_outputs: bool
                    ) -> tuple[str, ...]:
    """Local outputs gathered whole (unless ``local_outputs``: left as the rank's tokens)."""
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
        if local_outputs:
            continue
        with graph.inserting_before(output):
            whole = _insert(graph, collectives.cp_gather, (arg, dims[0]), arg, arg)
        output.replace_input_with(arg, whole)
        done.append(arg.name)
    return tuple(done)


__all__ = ["context_parallel", "seq_dims", "sequence_symbol"]
