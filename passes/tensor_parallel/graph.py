"""Editing a tensor-parallel rank's graph: parameters replaced by shards (ties kept),
collective nodes inserted with their metadata, a node replaced by its sharded form.

``Ties`` maps an original tensor to its shard, so tied names share the shard.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from cost_model.node_cost import NodeCost
from passes import meta
from passes.graph_utils import owner_of
from passes.tensor_parallel import collectives, costs

Ties = dict[int, nn.Parameter]


def attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def set_param(gm: torch.fx.GraphModule, fqn: str, value: torch.Tensor,
              original: torch.Tensor | None = None, ties: Ties | None = None) -> None:
    """Register ``value`` as the parameter ``fqn``; with ``original`` and ``ties``, a
    tensor already replaced under another name gets the same Parameter back."""
    owner, leaf = owner_of(gm, fqn)
    if original is not None and ties is not None and id(original) in ties:
        owner.register_parameter(leaf, ties[id(original)])
        return
    param = nn.Parameter(value, requires_grad=True)
    if original is not None and ties is not None:
        ties[id(original)] = param
    owner.register_parameter(leaf, param)


def retie(gm: torch.fx.GraphModule, ties: Ties) -> None:
    """Point every other name still holding a replaced tensor at its shard (torch.export
    keeps HF GPT-2's tied ``wte.weight`` attribute while the graph reads ``lm_head.weight``)."""
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        shard = ties.get(id(p))
        if shard is not None and shard is not p:
            set_param(gm, name, shard, original=p, ties=ties)


def replace_module(gm: torch.fx.GraphModule, path: str) -> None:
    """Put a fresh container at ``path`` (the original leaf module is the user's)."""
    owner, leaf = owner_of(gm, path)
    setattr(owner, leaf, nn.Module())


def shard(value: torch.Tensor, dim: int, size: int, rank: int, stride: int = 1
          ) -> torch.Tensor:
    """This rank's piece: ``value`` along ``dim`` is ``stride`` equal blocks (a fused
    q/k/v projection), each cut into ``size`` pieces; the rank's pieces concatenated."""
    blocks = value.detach().chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).clone()


def unshard(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from the ranks' ``shard`` pieces (in rank order): the inverse of
    ``shard``, block by block when ``stride`` > 1."""
    blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([b[i] for b in blocks], dim=dim) for i in range(stride)],
                     dim=dim)


def pad(value: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``value`` with ``rows`` zero rows appended along ``dim`` (a vocabulary padded to a
    multiple of the degree); ``value`` itself when ``rows`` is 0."""
    if not rows:
        return value
    extra = list(value.shape)
    extra[dim] = rows
    return torch.cat([value.detach(), value.new_zeros(extra)], dim=dim)


def unpad(value: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``value`` without its last ``rows`` rows along ``dim`` (the inverse of ``pad``)."""
    return value.narrow(dim, 0, value.shape[dim] - rows).contiguous() if rows else value


#: how each collective's output relates to its input: (split dim, grows)
SHAPES: dict[str, tuple[int | None, bool]] = {
    "tp_copy": (None, False), "tp_reduce": (None, False), "tp_sum": (None, False),
    "tp_gather_last": (-1, True),
    "tp_gather_batch": (0, True), "tp_split_batch": (0, False)}


SIZE_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset({
    operator.mul, operator.floordiv, torch.t, torch.transpose})
"""Inserted functions of sizes or of a weight: their ``val`` is computed from their args'."""


def _copy_meta(n: torch.fx.Node, like: torch.fx.Node) -> None:
    """``like``'s metadata on ``n``, but not what ``like`` saves: a column linear's input
    renamed to the gathered sequence would stay counted as the chunk on its gather."""
    n.meta = dict(like.meta)
    saved = meta.SAVED.get(n)
    if saved is not None:
        meta.SAVED.set(n, dataclasses.replace(saved, keys=(), extra=0))


def insert(graph: torch.fx.Graph, fn: Callable[..., Any], args: Sequence[Any],
           like: torch.fx.Node, size: int = 1) -> torch.fx.Node:
    """A ``call_function`` node of ``fn`` with ``like``'s metadata, its own shape (by
    ``SHAPES``), no cost yet (``costs.price_collectives``), no parameters and nothing
    saved (the collectives keep no tensor for backward)."""
    n = graph.call_function(fn, tuple(args))
    _copy_meta(n, like)
    src = args[0] if args and isinstance(args[0], torch.fx.Node) else None
    _set_val(n, fn, src)
    dim, grow = SHAPES.get(getattr(fn, "__name__", ""), (None, False))
    if src is not None:
        meta.TENSOR.set(n, costs.local_info(meta.TENSOR.get(src), dim, size, grow))
    meta.TP.set(n, getattr(fn, "__name__", "op"))
    meta.COST.set(n, NodeCost())
    meta.PARAMS.set(n, ())
    return n


def _set_val(n: torch.fx.Node, fn: Callable[..., Any], src: torch.fx.Node | None) -> None:
    """``n``'s ``val`` keeps the one-process graph's structure (which dims are the batch and
    the sequence, a tensor or a size), which later rewrites read (context parallelism):
    a collective's is its input's, a size's or a weight view's is computed from its args'."""
    if getattr(fn, "__module__", None) == collectives.__name__:
        if src is not None and "val" in src.meta:
            n.meta["val"] = src.meta["val"]
    elif fn in SIZE_FUNCTIONS:
        computed_val(n)


def computed_val(n: torch.fx.Node) -> None:
    """``n``'s ``val`` computed from its args' (a function of sizes or of a weight), where
    they have one (an export graph's; fx's have none)."""
    read: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), read.append)
    if callable(n.target) and all("val" in a.meta for a in read):
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
        n.meta["val"] = n.target(*args, **kwargs)


def get_attr(graph: torch.fx.Graph, fqn: str, like: torch.fx.Node) -> torch.fx.Node:
    n = graph.get_attr(fqn)
    _copy_meta(n, like)
    value = attr(graph.owning_module, fqn) if graph.owning_module is not None else None
    if isinstance(value, torch.Tensor):  # the shard, not ``like``'s activation
        n.meta["val"] = torch.empty_like(value, device="meta")
    meta.COST.set(n, NodeCost())
    meta.PARAMS.set(n, (fqn,))
    return n


def replace_node(graph: torch.fx.Graph, node: torch.fx.Node, new: torch.fx.Node,
                 views: Sequence[torch.fx.Node] = ()) -> None:
    """Put ``new`` (a linear's or embedding's sharded form, inserted beside it) in place of
    ``node``: its uses read ``new``, and ``node`` goes with the ``get_attr`` nodes of the
    full tensors that only it read, and the ``views`` of them (a transposed weight) it
    alone used."""
    inputs = node.all_input_nodes
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    for view in views:
        if not view.users:
            inputs += view.all_input_nodes
            graph.erase_node(view)
    for old in dict.fromkeys(a for a in inputs if a.op == "get_attr" and not a.users):
        graph.erase_node(old)


def gather_operands(graph: torch.fx.Graph,
                    uses: Sequence[tuple[torch.fx.Node, torch.fx.Node]], size: int) -> None:
    """Feed each (consumer, operand) the operand gathered over the tp group's batches
    (``collectives.tp_gather_batch``, one gather per operand, before its first
    consumer: ``uses`` are in graph order): the consumer's split input holds the group's
    batch (``prescaled_batch`` false)."""
    gathered: dict[torch.fx.Node, torch.fx.Node] = {}
    for consumer, operand in uses:
        if operand not in gathered:
            with graph.inserting_before(consumer):
                gathered[operand] = insert(graph, collectives.tp_gather_batch, (operand,),
                                           operand, size)
        consumer.replace_input_with(operand, gathered[operand])


def _read_of(consumer: torch.fx.Node, operand: torch.fx.Node) -> torch.fx.Node | None:
    """The input of ``consumer`` that is ``operand``, or its batch gather
    (``gather_operands``), or None."""
    return next((a for a in consumer.all_input_nodes if a is operand or (
        a.target is collectives.tp_gather_batch and a.args[0] is operand)), None)


def scatter_operands(graph: torch.fx.Graph,
                     slices: Mapping[tuple[torch.fx.Node, torch.fx.Node], tuple[int, int]],
                     size: int) -> None:
    """Feed each head-split consumer this rank's chunk (``collectives.tp_scatter``) of
    its replicated operand along the recorded (dim, blocks), after the operand's batch
    gather when ``gather_operands`` gave it one."""
    for (operand, consumer), (dim, block) in slices.items():
        read = _read_of(consumer, operand)
        if read is None:
            continue
        with graph.inserting_before(consumer):
            cut = insert(graph, collectives.tp_scatter, (read, dim, block), consumer, size)
        meta.TENSOR.set(cut, costs.local_info(meta.TENSOR.get(read), dim, size))
        meta.TP_SPLIT.set(cut, dim)
        consumer.replace_input_with(read, cut)


def copy_operands(graph: torch.fx.Graph, uses: Sequence[tuple[torch.fx.Node, torch.fx.Node]],
                  size: int) -> None:
    """Feed each (replicated operand, consumer) the operand through ``tp_copy`` (identity
    forward, all-reduce of the gradient): the consumer works on a split value, so each
    rank's gradient of the operand covers its part. One copy per operand (its batch
    gather's, when it has one), shared by its split consumers."""
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    for operand, consumer in uses:
        read = _read_of(consumer, operand)
        if read is None:
            continue
        if read not in copied:
            with graph.inserting_after(read):
                copied[read] = insert(graph, collectives.tp_copy, (read,), read, size)
        consumer.replace_input_with(read, copied[read])


def complete_partials(graph: torch.fx.Graph, partial: Mapping[torch.fx.Node, float],
                      size: int) -> None:
    """Follow each sum or mean over a split dim by ``collectives.tp_sum`` (the ranks'
    parts summed, times the scale), which its users then read."""
    for node, scale in partial.items():
        users = list(node.users)
        with graph.inserting_after(node):
            total = insert(graph, collectives.tp_sum, (node, scale), node, size)
        for user in users:
            user.replace_input_with(node, total)


def mark_gathered(graph: torch.fx.Graph) -> None:
    """Mark (``meta.TP_GATHERED``) every value computed on the tp group's gathered batch, whose
    batch size the runtime's shape guard cannot evaluate from the rank's inputs."""
    gathered: set[torch.fx.Node] = set()
    for n in graph.nodes:
        n.meta.pop(meta.TP_GATHERED.name, None)  # inserted nodes copied their like's meta
        role = meta.TP.get(n)
        if role == "tp_gather_batch" or (role != "tp_split_batch" and any(
                a in gathered for a in n.all_input_nodes)):
            gathered.add(n)
            meta.TP_GATHERED.set(n, True)


__all__ = ["SHAPES", "Ties", "attr", "complete_partials", "copy_operands", "gather_operands",
           "get_attr", "insert", "mark_gathered",
           "pad", "replace_module", "replace_node", "retie", "scatter_operands", "set_param",
           "shard", "unpad", "unshard"]
