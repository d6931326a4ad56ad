"""The linear layers tensor parallelism shards, in the layouts the frontends produce.

A *linear* is a node computing ``x @ W^T + b`` with ``W`` and ``b`` parameters:

* an ``nn.Linear`` leaf (``call_module``) or ``F.linear`` / ``aten.linear`` on
  parameters: ``W`` is ``(out, in)``;
* ``addmm(b, x, W)`` on parameters (Hugging Face's GPT-2 ``Conv1D``, on both the fx and
  the torch.export graph): ``W`` is ``(in, out)``, the layout is *transposed*.

``Linear`` records the node, its input and the parameters; ``sharded_node`` builds the
rank's replacement in the same layout, so a transposed weight's shard is still the
tensor ``Conv1D`` reads (its state-dict shape, split along the other dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from passes.tensor_parallel import graph

LINEAR_FUNCTIONS: frozenset[Any] = frozenset({F.linear, torch.ops.aten.linear.default})
ADDMM_FUNCTIONS: frozenset[Any] = frozenset({torch.addmm, torch.ops.aten.addmm.default})


@dataclass
class Linear:
    """One linear node; ``role``: "col", "row" or "lone", set by sharding propagation."""

    node: torch.fx.Node
    x: torch.fx.Node
    weight: str
    bias: str | None
    weight_value: torch.Tensor
    bias_value: torch.Tensor | None
    transposed: bool = False
    role: str = ""

    @property
    def x_pos(self) -> int:
        """Where the input is in the node's args (``addmm``'s bias comes first)."""
        return 1 if self.transposed and self.node.op == "call_function" else 0

    @property
    def out_features(self) -> int:
        return int(self.weight_value.shape[0 if not self.transposed else 1])

    @property
    def in_features(self) -> int:
        return int(self.weight_value.shape[1 if not self.transposed else 0])

    def weight_dim(self) -> int:
        """The weight dim a ``role`` splits: the outputs (col, lone) or the inputs (row)."""
        features_out = 0 if not self.transposed else 1
        return 1 - features_out if self.role == "row" else features_out


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
    if n.target in LINEAR_FUNCTIONS:
        args = list(n.args) + [n.kwargs.get("bias")] * (3 - len(n.args))
        x, w, b = args[0], args[1], args[2]
        transposed = False
    elif n.target in ADDMM_FUNCTIONS and len(n.args) == 3 and not n.kwargs:
        b, x, w = n.args  # beta = alpha = 1 (no kwargs): bias + x @ W
        transposed = True
    else:
        return None
    if not (isinstance(x, torch.fx.Node) and isinstance(w, torch.fx.Node) and _param(w)
            and (b is None or (isinstance(b, torch.fx.Node) and _param(b)))):
        return None
    bias = None if b is None else str(b.target)
    return Linear(n, x, str(w.target), bias, graph.attr(gm, str(w.target)),
                  None if bias is None else graph.attr(gm, bias), transposed)


def sharded_node(g: torch.fx.Graph, lin: Linear, x: torch.fx.Node, w: torch.fx.Node,
                 b: torch.fx.Node | None) -> torch.fx.Node:
    """The node computing the rank's part: ``x @ shard^T (+ bias shard)`` in ``lin``'s
    layout (a row linear's bias is added after the reduction, so ``b`` is None there)."""
    if not lin.transposed:
        return g.call_function(F.linear, (x, w) if b is None else (x, w, b))
    if b is None:
        return g.call_function(torch.mm, (x, w))
    return g.call_function(torch.addmm, (b, x, w))


__all__ = ["ADDMM_FUNCTIONS", "LINEAR_FUNCTIONS", "Linear", "as_linear", "sharded_node"]
