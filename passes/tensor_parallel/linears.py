"""The linear layers tensor parallelism shards, in the layouts the frontends produce.

``linear`` (weight ``(out, in)``), ``addmm`` (GPT-2's ``Conv1D``, ``(in, out)``),
``matmul`` on ``W.T`` (Falcon) and ``grouped`` (MoE experts); ``sharded_node`` keeps the
layout so a shard is still the tensor the module reads, split along one dim.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from passes.tensor_parallel import graph

LINEAR_FUNCTIONS: frozenset[Any] = frozenset({F.linear, torch.ops.aten.linear.default})
ADDMM_FUNCTIONS: frozenset[Any] = frozenset({torch.addmm, torch.ops.aten.addmm.default})
MATMUL_FUNCTIONS: frozenset[Any] = frozenset({torch.matmul, operator.matmul,
                                             torch.ops.aten.matmul.default})
TRANSPOSED_2D: frozenset[Any] = frozenset({torch.ops.aten.numpy_T.default,
                                           torch.ops.aten.t.default})
GROUPED_FUNCTIONS: frozenset[Any] = frozenset(
    f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None))
    if f is not None)
GROUPED_OPS: frozenset[str] = frozenset({"aten._grouped_mm.default",
                                         "transformers.grouped_mm_fallback.default"})
"""The grouped products of MoE experts: torch's, and the fallback op transformers
registers where torch has none (by name: it exists once transformers is imported)."""


def _grouped(target: Any) -> bool:
    return target in GROUPED_FUNCTIONS or str(target) in GROUPED_OPS


@dataclass
class Linear:
    """One linear node; ``role``: "col", "row" or "lone", set by sharding propagation.
    ``kind``: the layout (module docstring); ``views``: nodes between the weight's
    ``get_attr`` and the linear (a transpose), replaced with it."""

    node: torch.fx.Node
    x: torch.fx.Node
    weight: str
    bias: str | None
    weight_value: torch.Tensor
    bias_value: torch.Tensor | None
    kind: str = "linear"
    role: str = ""
    views: list[torch.fx.Node] = field(default_factory=list)

    @property
    def transposed(self) -> bool:
        """The weight is stored (in, out) (Conv1D's): kept for the plan's readers."""
        return self.kind == "addmm"

    @property
    def x_pos(self) -> int:
        """Where the input is in the node's args (``addmm``'s bias comes first)."""
        return 1 if self.kind == "addmm" and self.node.op == "call_function" else 0

    @property
    def out_dim(self) -> int:
        return {"addmm": 1, "grouped": 1}.get(self.kind, 0)

    @property
    def in_dim(self) -> int:
        return {"addmm": 0, "grouped": 2}.get(self.kind, 1)

    @property
    def out_features(self) -> int:
        return int(self.weight_value.shape[self.out_dim])

    @property
    def in_features(self) -> int:
        return int(self.weight_value.shape[self.in_dim])

    def weight_dim(self) -> int:
        """The weight dim a ``role`` splits: the outputs (col, lone) or the inputs (row)."""
        return self.in_dim if self.role == "row" else self.out_dim


def _param(n: Any) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "get_attr"


def as_linear(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Linear | None:
    """``n`` as a ``Linear``, or None when it is not one (or its weight is computed)."""
    if n.op == "call_module" and type(graph.attr(gm, str(n.target))) is nn.Linear:
        mod = graph.attr(gm, str(n.target))
        x = n.args[0]
        if not isinstance(x, torch.fx.Node):
            return None
        return Linear(n, x, f"{n.target}.weight",
                      None if mod.bias is None else f"{n.target}.bias", mod.weight, mod.bias)
    if n.op != "call_function":
        return None
    views: list[torch.fx.Node] = []
    kind = "linear"
    if n.target in LINEAR_FUNCTIONS:
        args = list(n.args) + [n.kwargs.get("bias")] * (3 - len(n.args))
        x, w, b = args[0], args[1], args[2]
    elif n.target in ADDMM_FUNCTIONS and len(n.args) == 3 and not n.kwargs:
        b, x, w = n.args  # beta = alpha = 1 (no kwargs): bias + x @ W
        kind = "addmm"
    elif n.target in MATMUL_FUNCTIONS and len(n.args) == 2 and _transposed_param(n.args[1]):
        x, t, b = n.args[0], n.args[1], None
        assert isinstance(t, torch.fx.Node)
        w, views, kind = t.args[0], [t], "matmul"
    elif _grouped(n.target) and len(n.args) >= 3 and _expert_weight(n.args[1]):
        x, w, b = n.args[0], n.args[1], None
        assert isinstance(w, torch.fx.Node)
        if w.op != "get_attr":
            first = w.args[0]
            assert isinstance(first, torch.fx.Node)
            w, views = first, [w]
        kind = "grouped"
    else:
        return None
    if not (isinstance(x, torch.fx.Node) and isinstance(w, torch.fx.Node) and _param(w)
            and (b is None or (isinstance(b, torch.fx.Node) and _param(b)))
            and all(len(v.users) == 1 for v in views)):
        return None
    bias = None if b is None else str(b.target)
    lin = Linear(n, x, str(w.target), bias, graph.attr(gm, str(w.target)),
                 None if bias is None else graph.attr(gm, bias), kind, views=views)
    if kind == "grouped" and not views:  # stored (experts, in, out): transposed experts
        return None
    return lin if lin.weight_value.dim() == (3 if kind == "grouped" else 2) else None


def _transposed_param(t: Any) -> bool:
    """``t`` is a 2-D parameter transposed (``W.T``)."""
    if not isinstance(t, torch.fx.Node) or not t.args or not _param(t.args[0]):
        return False
    if t.target in TRANSPOSED_2D or (t.op == "call_method" and t.target == "t"):
        return True
    if t.target is getattr:  # an fx graph's ``W.T``
        return len(t.args) == 2 and t.args[1] == "T"
    return t.target is torch.ops.aten.transpose.int and \
        sorted(d % 2 for d in t.args[1:3]) == [0, 1]  # type: ignore[operator]


def _expert_weight(w: Any) -> bool:
    """``w`` is a 3-D experts' weight ``(experts, out, in)`` read transposed."""
    return isinstance(w, torch.fx.Node) and (_param(w) or (
        w.target is torch.ops.aten.transpose.int and bool(w.args) and _param(w.args[0])
        and sorted(d % 3 for d in w.args[1:3]) == [1, 2]))  # type: ignore[operator]


def sharded_node(g: torch.fx.Graph, lin: Linear, x: torch.fx.Node, w: torch.fx.Node,
                 b: torch.fx.Node | None) -> torch.fx.Node:
    """The node computing the rank's part: ``x @ shard^T (+ bias shard)`` in ``lin``'s
    layout (a row linear's bias is added after the reduction, so ``b`` is None there)."""
    if lin.kind == "addmm":
        return g.call_function(torch.mm, (x, w)) if b is None else \
            g.call_function(torch.addmm, (b, x, w))
    if lin.kind == "matmul":
        return g.call_function(torch.matmul, (x, graph.insert(g, torch.t, (w,), lin.node)))
    if lin.kind == "grouped":
        wt = graph.insert(g, torch.transpose, (w, -2, -1), lin.node)
        target: Any = lin.node.target
        return g.call_function(target, (x, wt, *lin.node.args[2:]), dict(lin.node.kwargs))
    return g.call_function(F.linear, (x, w) if b is None else (x, w, b))


__all__ = ["ADDMM_FUNCTIONS", "GROUPED_FUNCTIONS", "GROUPED_OPS", "LINEAR_FUNCTIONS",
           "MATMUL_FUNCTIONS", "Linear", "as_linear", "sharded_node"]
