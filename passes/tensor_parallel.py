"""``tensor_parallel``: shard the linears of marked modules across the tensor-parallel group.

For every marked region (an outermost module marked by ``smp.tensor_parallelism``,
``smp.set_tensor_parallelism`` or an ``smp.nn`` type; given as module paths), the pass
finds the linears (``nn.Linear`` leaves, ``F.linear`` / ``aten.linear`` on parameters)
and pairs them Megatron-style:

* a *column-parallel* linear (weight rows split: each rank computes ``out/tp`` features)
  whose output flows only through element-wise ops (activations, dropout, bias adds,
  SwiGLU's ``gate * up``) into
* a *row-parallel* linear (weight columns split) whose partial sums are all-reduced, then
  its bias is added once.

A linear whose output no element-wise chain carries to another linear is a lone linear
with ``smp.nn.DistributedLinear``'s semantics: column-parallel, its output all-gathered
along the features. Collectives are ``call_function`` nodes of ``passes.tp_collectives``.
With ``prescaled_batch`` false each pair (and each lone linear) gathers its input over the
tp group's batches and keeps this rank's part of the output.

A region the pass cannot shard (sizes not divisible by tp, a column-sharded value reaching
anything but an element-wise op or a linear, no linear at all) stays replicated, and
``TensorParallelPlan.replicated`` says why. The result depends on ``rank``: each rank's
graph holds its own shards, under the original parameter names; every rank's graph has
the same nodes, names and stages.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from cost_model.node_cost import NodeCost
from passes import meta, tp_collectives, tp_rules
from passes.graph_utils import copy_graph_module


@dataclass(frozen=True)
class TensorParallelism:
    """The rewrite's inputs: degree, this rank, batch semantics, marked module paths."""

    size: int
    rank: int
    prescaled_batch: bool = False
    marked: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardSpec:
    """One distributed parameter: split along ``dim`` into ``parts`` equal pieces.

    ``stride`` > 1: along ``dim`` the full tensor is ``stride`` equal blocks (a fused
    q/k/v projection: 3), each split into ``parts`` pieces; rank r holds piece r of every
    block, concatenated in block order. Merging: cut each rank's shard into ``stride``
    blocks, concatenate the ranks' block b pieces, then the blocks."""

    name: str
    dim: int
    parts: int
    full_shape: tuple[int, ...]
    stride: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dim": self.dim, "parts": self.parts,
                "full_shape": list(self.full_shape), "stride": self.stride}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> ShardSpec:
        return ShardSpec(d["name"], d["dim"], d["parts"], tuple(d["full_shape"]),
                         int(d.get("stride", 1)))


@dataclass(frozen=True)
class TensorParallelPlan:
    """What the pass did: sharded parameters and the regions left replicated, with why."""

    size: int
    sharded: tuple[ShardSpec, ...] = ()
    replicated: tuple[tuple[str, str], ...] = ()
    pairs: tuple[tuple[str, str], ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sharded": [s.to_json() for s in self.sharded],
                "replicated": [list(r) for r in self.replicated],
                "pairs": [list(p) for p in self.pairs]}

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> TensorParallelPlan:
        return TensorParallelPlan(d["size"], tuple(ShardSpec.from_json(s) for s in d["sharded"]),
                                  tuple((a, b) for a, b in d["replicated"]),
                                  tuple((a, b) for a, b in d["pairs"]))

    def shard_spec(self, name: str) -> ShardSpec | None:
        return next((s for s in self.sharded if s.name == name), None)


ELEMENTWISE_MODULES: tuple[type, ...] = (
    nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU)
ELEMENTWISE_FUNCTIONS: frozenset[Any] = frozenset({
    F.gelu, F.relu, F.silu, F.dropout, F.leaky_relu, torch.relu, torch.tanh, torch.sigmoid,
    torch.mul, torch.add, operator.mul, operator.add, operator.sub, operator.truediv,
    torch.ops.aten.gelu.default, torch.ops.aten.silu.default, torch.ops.aten.relu.default,
    torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor, torch.ops.aten.tanh.default,
    torch.ops.aten.sigmoid.default, torch.ops.aten.dropout.default,
})
ELEMENTWISE_METHODS: frozenset[str] = frozenset(
    {"relu", "sigmoid", "tanh", "mul", "add", "sub", "div", "__mul__", "__add__"})
LINEAR_FUNCTIONS: frozenset[Any] = frozenset({F.linear, torch.ops.aten.linear.default})


@dataclass
class _Linear:
    node: torch.fx.Node
    weight: str
    bias: str | None
    weight_value: torch.Tensor
    bias_value: torch.Tensor | None
    role: str = ""  # "col", "row" or "lone"
    partner: str = ""  # a row linear's column linear (node name)


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _as_linear(gm: torch.fx.GraphModule, n: torch.fx.Node) -> _Linear | None:
    if n.op == "call_module" and type(_attr(gm, str(n.target))) is nn.Linear:
        mod = _attr(gm, str(n.target))
        return _Linear(n, f"{n.target}.weight", None if mod.bias is None else f"{n.target}.bias",
                       mod.weight, mod.bias)
    if n.op == "call_function" and n.target in LINEAR_FUNCTIONS:
        args = list(n.args) + [n.kwargs.get("bias")] * (3 - len(n.args))
        w, b = args[1], args[2]
        if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"):
            return None
        if b is not None and not (isinstance(b, torch.fx.Node) and b.op == "get_attr"):
            return None
        return _Linear(n, str(w.target), None if b is None else str(b.target),
                       _attr(gm, str(w.target)), None if b is None else _attr(gm, str(b.target)))
    return None


def _elementwise(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(_attr(gm, str(n.target)), ELEMENTWISE_MODULES)
    if n.op == "call_function":
        return n.target in ELEMENTWISE_FUNCTIONS
    return n.op == "call_method" and n.target in ELEMENTWISE_METHODS


def _in_region(path: str, region: str) -> bool:
    return region == "" or path == region or path.startswith(region + ".")


def regions(marked: Sequence[str]) -> list[tuple[str, ...]]:
    """The outermost marked paths, siblings grouped (modules created together inside one
    ``smp.tensor_parallelism`` context form one region)."""
    outer = sorted({r for r in marked if not any(r != o and _in_region(r, o) for o in marked)})
    groups: dict[str, list[str]] = {}
    for path in outer:
        groups.setdefault(path.rpartition(".")[0] if path else "\0", []).append(path)
    return [tuple(g) for _, g in sorted(groups.items())]


def _linears(gm: torch.fx.GraphModule, region: tuple[str, ...], skip: frozenset[str]
             ) -> dict[torch.fx.Node, _Linear]:
    return {n: lin for n in gm.graph.nodes
            if any(_in_region(meta.MODULE_PATH.get(n, ""), r) for r in region)
            and (lin := _as_linear(gm, n)) is not None and lin.weight not in skip}


def _analyse(gm: torch.fx.GraphModule, region: tuple[str, ...], size: int,
             skip: frozenset[str] = frozenset()
             ) -> tuple[list[_Linear], tp_rules.Rewrites, str | None]:
    """The region's linears with their roles and the shape edits, or a reason to leave it
    replicated. A column linear whose output no rule carries on is a lone linear."""
    linears = _linears(gm, region, skip)
    if not linears:
        return [], tp_rules.Rewrites(), "no linear layer to shard"
    weights = [id(lin.weight_value) for lin in linears.values()]
    if len(set(weights)) != len(weights):
        return [], tp_rules.Rewrites(), "a linear weight is shared by several layers"
    lone: set[torch.fx.Node] = set()
    while True:
        rw, reason, culprit = _propagate(gm, linears, lone, size)
        if culprit is None or culprit in lone:
            break
        lone.add(culprit)
    if reason is not None:
        return [], rw, reason
    for lin in linears.values():
        out_f, in_f = lin.weight_value.shape
        dim_size = in_f if lin.role == "row" else out_f
        parts = size * rw.strided.get(lin.node.name, 1)
        if dim_size % parts:
            return [], rw, (f"{lin.weight} has {dim_size} {'in' if lin.role == 'row' else 'out'}"
                            f" features, not divisible by tensor_parallel_degree {size}"
                            + (f" x {parts // size} fused blocks" if parts != size else ""))
    return list(linears.values()), rw, None


def _propagate(gm: torch.fx.GraphModule, linears: dict[torch.fx.Node, _Linear],
               lone: set[torch.fx.Node], size: int
               ) -> tuple[tp_rules.Rewrites, str | None, torch.fx.Node | None]:
    """One sweep of sharding propagation: the edits, the first failure and, when that
    failure is a column linear's own output, that linear (to retry it as a lone one)."""
    split: dict[torch.fx.Node, tp_rules.Split] = {}
    rw = tp_rules.Rewrites()
    by_name = {n.name: n for n in linears}
    for n in gm.graph.nodes:
        lin = linears.get(n)
        if lin is not None:
            x = n.args[0]
            if x in split:
                rank = len(tp_rules.shape(x) or ())
                if split[x].dim not in (-1, rank - 1):
                    return rw, (f"{lin.weight} reads {x.name} split along dim "
                                f"{split[x].dim}, not its features"), None
                lin.role, lin.partner = "row", split[x].origin
            elif n in lone:
                lin.role = "lone"
            else:
                lin.role = "col"
                out = tp_rules.shape(n)
                split[n] = tp_rules.Split(-1 if out is None else len(out) - 1, n.name)
            continue
        ins = [a for a in n.all_input_nodes if a in split]
        if not ins:
            continue
        try:
            out_split = _rule(gm, n, split, rw, size, by_name.get)
        except tp_rules.Unsupported as exc:
            return rw, str(exc), next((a for a in ins if a in linears), None)
        if out_split is None:
            return rw, (f"the split value {ins[0].name} reaches {n.name} ({n.target}), "
                        "which no sharding rule covers"), next((a for a in ins if a in linears),
                                                               None)
        split[n] = out_split
    return rw, None, None


def _rule(gm: torch.fx.GraphModule, n: torch.fx.Node,
          split: dict[torch.fx.Node, tp_rules.Split], rw: tp_rules.Rewrites, size: int,
          col: Callable[[str], torch.fx.Node | None]) -> tp_rules.Split | None:
    if _elementwise(gm, n):
        ins = [a for a in n.all_input_nodes if a in split]
        if any(tp_rules.shape(a) is None for a in n.all_input_nodes):
            if len(ins) != len(n.all_input_nodes) or len({split[a].dim for a in ins}) != 1:
                raise tp_rules.Unsupported(f"{n.name} ({n.target}) mixes a feature-split "
                                           "value with a replicated tensor")
            origins = sorted({o for a in ins for o in split[a].origin.split(",")})
            return tp_rules.Split(split[ins[0]].dim, ",".join(origins))
        return tp_rules.elementwise_out(n, split)
    return tp_rules.propagate(n, split, rw, size, col)


def _set_param(gm: torch.fx.GraphModule, fqn: str, value: torch.Tensor) -> None:
    owner_path, _, leaf = fqn.rpartition(".")
    owner: nn.Module = gm
    for part in owner_path.split(".") if owner_path else ():
        owner = getattr(owner, part)
    owner.register_parameter(leaf, nn.Parameter(value, requires_grad=True))


def _replace_module(gm: torch.fx.GraphModule, path: str) -> None:
    """Put a fresh container at ``path`` (the original leaf module is the user's)."""
    owner_path, _, leaf = path.rpartition(".")
    owner: nn.Module = gm
    for part in owner_path.split(".") if owner_path else ():
        owner = getattr(owner, part)
    setattr(owner, leaf, nn.Module())


def merge_shards(spec: ShardSpec, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the ranks' shards (in rank order), strides honoured."""
    blocks = [s.chunk(spec.stride, dim=spec.dim) for s in shards]
    return torch.cat([torch.cat([b[i] for b in blocks], dim=spec.dim)
                      for i in range(spec.stride)], dim=spec.dim)


def _shard(value: torch.Tensor, dim: int, size: int, rank: int, stride: int = 1
           ) -> torch.Tensor:
    """This rank's piece: ``value`` along ``dim`` is ``stride`` equal blocks (a fused
    q/k/v projection), each cut into ``size`` pieces; the rank's pieces concatenated."""
    blocks = value.detach().chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).clone()


def tensor_parallel(gm: torch.fx.GraphModule, tp: TensorParallelism,
                    skip: frozenset[str] = frozenset()
                    ) -> tuple[torch.fx.GraphModule, TensorParallelPlan]:
    """The rewritten copy of ``gm`` for ``tp.rank`` and the plan (module docstring);
    linears whose weight is in ``skip`` are left alone (another pass sharded them)."""
    new = copy_graph_module(gm)
    if tp.size <= 1 or not tp.marked:
        return new, TensorParallelPlan(tp.size)
    by_name = {n.name: n for n in new.graph.nodes}
    sharded: list[ShardSpec] = []
    replicated: list[tuple[str, str]] = []
    pairs: list[tuple[str, str]] = []
    for region in regions(tp.marked):
        linears, rw, reason = _analyse(new, region, tp.size, skip)
        if reason is not None:
            replicated.append((",".join(region), reason))
            continue
        names = {lin.node.name: lin.weight.rpartition(".")[0] for lin in linears}
        for node, pos in rw.divide:
            _scale_arg(new.graph, node, pos, operator.floordiv, tp.size)
        for node, pos in rw.batch if not tp.prescaled_batch else ():
            _scale_arg(new.graph, node, pos, operator.mul, tp.size)
        for lin in linears:
            stride = rw.strided.get(lin.node.name, 1)
            sharded += _rewrite(new, by_name[lin.node.name], lin, tp, stride)
        pairs += [(names[c], names[r.node.name]) for r in linears if r.role == "row"
                  for c in r.partner.split(",")]
    new.graph.lint()
    new.recompile()
    return new, TensorParallelPlan(tp.size, tuple(sharded), tuple(replicated), tuple(pairs))


def _scale_arg(graph: torch.fx.Graph, node: torch.fx.Node, pos: int | str,
               op: Callable[[Any, int], Any], size: int) -> None:
    """Turn a size argument of ``node`` into this rank's: a global feature size
    ``// tp``, a local batch size ``* tp`` (the batch gathered over the tp group)."""
    value = node.args[pos] if isinstance(pos, int) else node.kwargs[pos]
    if isinstance(value, torch.fx.Node):
        with graph.inserting_before(node):
            value = _insert(graph, op, (value, size), node)
            meta.TENSOR.set(value, None)
    else:
        value = op(value, size)
    if isinstance(pos, int):
        node.update_arg(pos, value)
    else:
        node.update_kwarg(pos, value)


def _insert(graph: torch.fx.Graph, fn: Callable[..., Any], args: Sequence[Any],
            like: torch.fx.Node) -> torch.fx.Node:
    n = graph.call_function(fn, tuple(args))
    n.meta = dict(like.meta)
    meta.TP.set(n, getattr(fn, "__name__", "op"))
    meta.COST.set(n, NodeCost())
    meta.PARAMS.set(n, ())
    return n


def _get_attr(graph: torch.fx.Graph, fqn: str, like: torch.fx.Node) -> torch.fx.Node:
    n = graph.get_attr(fqn)
    n.meta = dict(like.meta)
    meta.COST.set(n, NodeCost())
    meta.PARAMS.set(n, (fqn,))
    return n


def _rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node, lin: _Linear,
             tp: TensorParallelism, stride: int = 1) -> list[ShardSpec]:
    """Replace ``node`` by its sharded form; the shard specs of its parameters."""
    size, rank, graph = tp.size, tp.rank, gm.graph
    w_full, b_full = lin.weight_value, lin.bias_value
    if node.op == "call_module":
        _replace_module(gm, str(node.target))
    w_dim = 1 if lin.role == "row" else 0
    _set_param(gm, lin.weight, _shard(w_full, w_dim, size, rank, stride))
    specs = [ShardSpec(lin.weight, w_dim, size, tuple(w_full.shape), stride)]
    if lin.bias is not None and b_full is not None:
        if lin.role == "row":
            _set_param(gm, lin.bias, b_full.detach().clone())
        else:
            _set_param(gm, lin.bias, _shard(b_full, 0, size, rank, stride))
            specs.append(ShardSpec(lin.bias, 0, size, tuple(b_full.shape), stride))
    x = node.args[0]
    gather = not tp.prescaled_batch
    with graph.inserting_before(node):
        if lin.role != "row":
            if gather:
                x = _insert(graph, tp_collectives.tp_gather_batch, (x,), node)
            x = _insert(graph, tp_collectives.tp_copy, (x,), node)
        w = _get_attr(graph, lin.weight, node)
        args: list[Any] = [x, w]
        if lin.bias is not None and lin.role != "row":
            args.append(_get_attr(graph, lin.bias, node))
        y = graph.call_function(F.linear, tuple(args))
        y.meta = dict(node.meta)
        meta.TP.set(y, lin.role)
        meta.PARAMS.set(y, tuple(a.target for a in args[1:]))
    with graph.inserting_after(y):
        out = y
        if lin.role == "row":
            out = _insert(graph, tp_collectives.tp_reduce, (out,), node)
            if lin.bias is not None:
                with graph.inserting_after(out):
                    b = _get_attr(graph, lin.bias, node)
                with graph.inserting_after(b):
                    out = _insert(graph, operator.add, (out, b), node)
        elif lin.role == "lone":
            out = _insert(graph, tp_collectives.tp_gather_last, (out,), node)
        if gather and lin.role != "col":
            with graph.inserting_after(out):
                out = _insert(graph, tp_collectives.tp_split_batch, (out,), node)
    inputs = node.all_input_nodes
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    for old in (a for a in inputs if a.op == "get_attr" and not a.users):
        graph.erase_node(old)
    return specs
