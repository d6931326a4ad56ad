"""The op targets tensor parallelism's sharding rules know, by family, as the frontends
spell them: ``call_method`` names, torch functions and aten overloads.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from passes.tensor_parallel import graph

aten = torch.ops.aten

PASS_THROUGH_METHODS = frozenset({"contiguous", "float", "half", "to", "type_as", "clone"})
PASS_THROUGH_FUNCTIONS: frozenset[Any] = frozenset({
    torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default, torch.ops.aten.alias.default, torch.ops.aten.contiguous.default,
    torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten.type_as.default})
"""Ops whose output (if any) is split like their first input: casts, copies, and
torch.export's dtype assertions (which name no sizes)."""
SLICES: frozenset[Any] = frozenset({torch.ops.aten.slice.Tensor, torch.ops.aten.narrow.default})
CATS: frozenset[Any] = frozenset({torch.cat, torch.ops.aten.cat.default})
UNSQUEEZES: frozenset[Any] = frozenset({"unsqueeze", torch.unsqueeze,
                                        torch.ops.aten.unsqueeze.default})
EXPANDS: frozenset[Any] = frozenset({"expand", torch.ops.aten.expand.default})
SIZE_READS: frozenset[Any] = frozenset({torch.ops.aten.sym_size.int, "size"})
TRANSPOSES: frozenset[Any] = frozenset({"transpose", torch.transpose,
                                        torch.ops.aten.transpose.int})
VIEWS: frozenset[Any] = frozenset({"view", "reshape", torch.reshape,
                                   torch.ops.aten.view.default,
                                   torch.ops.aten.reshape.default})
SPLITS: frozenset[Any] = frozenset({"split", torch.split, aten.split.Tensor,
                                    aten.split_with_sizes.default, "chunk", torch.chunk,
                                    aten.chunk.default})
UNBINDS: frozenset[Any] = frozenset({"unbind", torch.unbind, aten.unbind.int})
SELECTS: frozenset[Any] = frozenset({"select", torch.select, aten.select.int, "squeeze",
                                     torch.squeeze, aten.squeeze.dim, aten.squeeze.dims,
                                     aten.squeeze.default})
STACKS: frozenset[Any] = frozenset({torch.stack, aten.stack.default})
REDUCTIONS: frozenset[Any] = frozenset({"mean", torch.mean, aten.mean.dim, "sum", torch.sum,
                                        aten.sum.dim_IntList})
"""Sums and means over listed dims (RMSNorm's ``x.pow(2).mean(-1, keepdim=True)``)."""
FLATTENS: frozenset[Any] = frozenset({"flatten", torch.flatten, aten.flatten.using_ints})
REPEATS: frozenset[Any] = frozenset({"repeat", aten.repeat.default})
GATHERS: frozenset[Any] = frozenset({torch.gather, "gather", aten.gather.default})
BADDBMM: frozenset[Any] = frozenset({torch.baddbmm, "baddbmm", aten.baddbmm.default})
SDPA: frozenset[Any] = frozenset({F.scaled_dot_product_attention,
                                  torch.ops.aten.scaled_dot_product_attention.default})
SOFTMAX: frozenset[Any] = frozenset({"softmax", F.softmax, torch.softmax,
                                     torch.ops.aten._softmax.default, torch.ops.aten.softmax.int})
PERMUTES: frozenset[Any] = frozenset({"permute", torch.permute, aten.permute.default})
MATMUL: frozenset[Any] = frozenset({"matmul", torch.matmul, operator.matmul, torch.bmm,
                                    torch.ops.aten.matmul.default, torch.ops.aten.bmm.default})


ELEMENTWISE_MODULES: tuple[type, ...] = (
    nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU)
ELEMENTWISE_FUNCTIONS: frozenset[Any] = frozenset({
    F.gelu, F.relu, F.silu, F.dropout, F.leaky_relu, torch.relu, torch.tanh, torch.sigmoid,
    torch.mul, torch.add, torch.pow, operator.mul, operator.add, operator.sub,
    operator.truediv, operator.pow,
    torch.ops.aten.gelu.default, torch.ops.aten.silu.default, torch.ops.aten.relu.default,
    torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor, torch.ops.aten.tanh.default,
    torch.ops.aten.sigmoid.default, torch.ops.aten.dropout.default,
    torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.sub.Tensor, torch.ops.aten.div.Tensor,
    torch.ops.aten.neg.default, torch.neg, operator.neg,
    torch.rsqrt, torch.sqrt, torch.exp, torch.erf, torch.where, torch.clamp, torch.abs,
    aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.erf.default,
    aten.reciprocal.default, aten.where.self, aten.masked_fill.Scalar, aten.clamp.default,
    aten.abs.default, aten.mul.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.div.Scalar,
    aten.pow.Tensor_Tensor, aten.square.default, aten.gelu_backward.default,
    aten.native_dropout.default, aten.log.default, aten.softplus.default,
    aten.leaky_relu.default, aten.elu.default, aten.hardtanh.default, aten.tanh_backward.default,
    aten.maximum.default, aten.minimum.default, aten.rsub.Scalar,
    aten.add_.Tensor, aten.mul_.Tensor, aten.sub_.Tensor, aten.div_.Tensor,
    aten.masked_fill_.Scalar, operator.iadd, operator.imul,
})
ELEMENTWISE_METHODS: frozenset[str] = frozenset(
    {"relu", "sigmoid", "tanh", "mul", "add", "sub", "div", "pow", "__mul__", "__add__",
     "rsqrt", "sqrt", "exp", "masked_fill", "clamp", "abs", "neg", "square"})


def elementwise(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(graph.attr(gm, str(n.target)), ELEMENTWISE_MODULES)
    if n.op == "call_function":
        return n.target in ELEMENTWISE_FUNCTIONS
    return n.op == "call_method" and n.target in ELEMENTWISE_METHODS



__all__ = ["BADDBMM", "CATS", "ELEMENTWISE_FUNCTIONS", "ELEMENTWISE_METHODS",
           "ELEMENTWISE_MODULES", "EXPANDS", "FLATTENS", "GATHERS", "MATMUL",
           "PASS_THROUGH_FUNCTIONS", "PASS_THROUGH_METHODS", "PERMUTES", "REDUCTIONS",
           "REPEATS", "SDPA", "SELECTS", "SIZE_READS", "SLICES", "SOFTMAX", "SPLITS", "STACKS",
           "TRANSPOSES", "UNBINDS", "UNSQUEEZES", "VIEWS", "elementwise"]
