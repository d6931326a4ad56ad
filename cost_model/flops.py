"""FLOP formulas per canonical op: shapes in, (forward, backward) FLOPs out.

A multiply-add counts 2 FLOPs; a contraction's backward is 2x its forward. ``op_flops``
returns ``None`` for an unknown op so the caller marks the cost unknown, not free.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Shape = tuple[int, ...]
MaybeShape = Shape | None

VIEW_OPS = frozenset({
    "view", "reshape", "_unsafe_view", "transpose", "t", "permute", "split", "split_with_sizes",
    "chunk", "unbind", "getitem", "unsqueeze", "squeeze", "flatten", "expand", "expand_as",
    "slice", "select", "narrow", "alias", "detach", "identity", "getattr", "size", "dim",
    "numel", "to", "type_as", "view_as", "unflatten", "movedim", "contiguous", "clone",
    "_to_copy", "type", "float", "lift_fresh_copy", "dropout_eval",
})
"""Ops that move or re-label data but do no arithmetic (0 FLOPs)."""

CREATION_OPS = frozenset({
    "arange", "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like",
    "empty_like", "scalar_tensor", "tensor", "new_zeros", "new_ones", "new_empty", "new_full",
    "triu", "tril", "cat", "stack", "sym_size", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_not", "logical_and", "bitwise_not", "finfo", "_assert_tensor_metadata",
    "assert", "assert_is_none",
    "sym_numel", "floordiv", "index_select", "gather", "repeat", "masked_fill_mask",
    "assert_tensor_metadata", "and", "or", "bitwise_and", "bitwise_or", "any", "all",
    "item", "sym_constrain_range_for_size", "diff", "floor_divide", "histc", "sort",
    "argsort", "pad", "constant_pad_nd", "mod", "sym_min", "sym_max", "sym_not", "sym_float",
    "sym_int", "sym_ite", "sign", "ceil", "floor", "round", "repeat_interleave", "topk",
    "index_put",
})
"""Ops producing values without gradient-relevant arithmetic (index math, masks, copies)."""

ELEMENTWISE_COST = {
    "add": 1, "sub": 1, "mul": 1, "div": 1, "truediv": 1, "neg": 1, "relu": 1, "abs": 1,
    "pow": 1, "sqrt": 1, "rsqrt": 1, "exp": 1, "log": 1, "where": 1, "masked_fill": 1,
    "clamp": 1, "maximum": 1, "minimum": 1, "rsub": 1, "iadd": 1, "imul": 1,
    "gelu": 8, "tanh": 4, "sigmoid": 4, "silu": 5, "dropout": 2, "softmax": 5,
    "log_softmax": 5, "erf": 4, "leaky_relu": 1, "hardtanh": 1, "cumsum": 1, "index": 1,
    "sin": 4, "cos": 4,
}
"""FLOPs per output element, forward; backward costs the same per element."""

REDUCTION_OPS = frozenset({"sum", "mean", "amax", "max", "min", "amin", "var", "std",
                           "norm", "avg_pool", "max_pool", "adaptive_avg_pool"})

LOSS_COST = {"cross_entropy": 6, "cross_entropy_loss": 6, "nll_loss": 1,
             "tp_vocab_cross_entropy": 6}
"""FLOPs per logit of a loss inside the model (log-softmax and the target's pick)."""

NORM_COST = 5
"""FLOPs per element of a normalisation (mean, variance, scale, shift) forward."""


def numel(shape: MaybeShape) -> int:
    return math.prod(shape) if shape is not None else 0


def linear_flops(in_shape: Shape, out_shape: Shape) -> float:
    """``y = x W^T (+ b)``: 2 * (output elements) * in_features; bias adds are ignored."""
    return 2.0 * numel(out_shape) * in_shape[-1]


def matmul_flops(a: Shape, b: Shape, out_shape: Shape) -> float:
    """Batched ``a @ b``: 2 * (output elements) * contraction length."""
    k = a[-1] if len(a) > 1 else a[0]
    return 2.0 * numel(out_shape) * k


def conv_flops(weight: Shape, out_shape: Shape, groups: int = 1) -> float:
    """2 * (output elements) * (input channels per group) * (kernel elements)."""
    del groups
    return 2.0 * numel(out_shape) * numel(weight[1:])


def sdpa_flops(q: Shape, k: Shape, v: Shape) -> float:
    """Attention: 2*B*H*L*S*E (scores) + 2*B*H*L*S*Ev (mix); a causal mask is not subtracted
    (an upper bound for flash kernels)."""
    batch_heads = numel(q[:-2])
    length, e = q[-2], q[-1]
    s, ev = k[-2], v[-1]
    return 2.0 * batch_heads * length * s * e + 2.0 * batch_heads * length * s * ev


def gemm_dims(op: str, inputs: Sequence[MaybeShape], output: MaybeShape,
              attrs: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """(m, k, n) of the matmul an op performs, ``None`` if it is no matmul.

    >>> gemm_dims("linear", [(16, 512)], (16, 2048), {})
    (16, 512, 2048)
    """
    try:
        if op == "linear" and inputs and inputs[0] and output:
            return numel(output[:-1]), inputs[0][-1], output[-1]
        if op in ("matmul", "mm", "bmm", "addmm", "baddbmm", "einsum_mm"):
            a, b = (inputs[1], inputs[2]) if op in ("addmm", "baddbmm") else inputs[:2]
            if a is None or b is None:
                return None
            m = a[-2] if len(a) > 1 else 1
            n = b[-1] if len(b) > 1 else 1
            if op == "matmul" and len(b) == 2:
                m = numel(a[:-1])  # x @ W folds the batch into the rows
            return m, a[-1], n
        if op == "grouped_mm" and inputs[0] and inputs[1]:
            a, b = inputs[0], inputs[1]  # (rows of all groups, k) @ (groups, k, n)
            groups = b[0] if len(b) == 3 else 1
            return max(1, a[-2] // groups), a[-1], b[-1]
        if op == "conv" and output:
            weight = attrs.get("weight") or inputs[1]
            if weight is None:
                return None
            return output[0] * numel(output[2:]), numel(weight[1:]), weight[0]
        if op == "sdpa" and inputs[0] and inputs[1]:
            q, k = inputs[0], inputs[1]
            return q[-2], q[-1], k[-2]
    except (IndexError, TypeError):
        return None
    return None


def op_flops(op: str, inputs: Sequence[MaybeShape], output: MaybeShape,
             attrs: Mapping[str, Any]) -> tuple[float, float] | None:
    """(forward, backward) FLOPs of one op; ``None`` if the op is unknown."""
    if op in VIEW_OPS or op in CREATION_OPS:
        return 0.0, 0.0
    if output is None and op not in ("sdpa",):
        return 0.0, 0.0
    gemm: tuple[Callable[..., float], tuple[MaybeShape, ...]] | None = None
    if op == "linear":
        gemm = linear_flops, (inputs[0], output)
    elif op == "addmm":
        gemm = matmul_flops, (inputs[1], inputs[2], output)
    elif op in ("matmul", "mm", "bmm", "baddbmm", "einsum_mm", "grouped_mm"):
        a, b = (inputs[1], inputs[2]) if op == "baddbmm" else (inputs[0], inputs[1])
        gemm = matmul_flops, (a, b, output)
    elif op == "conv":
        conv = functools.partial(conv_flops, groups=int(attrs.get("groups", 1)))
        gemm = conv, (attrs.get("weight") or inputs[1], output)
    elif op == "sdpa":
        gemm = sdpa_flops, (inputs[0], inputs[1], inputs[2])
    if gemm is not None:
        fn, shapes = gemm
        if any(x is None for x in shapes):
            return None  # a shape is unknown, so are the FLOPs
        fwd = fn(*shapes)
    elif op in ("layer_norm", "batch_norm", "group_norm", "rms_norm"):
        fwd = NORM_COST * numel(inputs[0])
    elif op == "embedding":
        return 0.0, float(numel(output))  # a gather forward; a scatter-add backward
    elif op in ELEMENTWISE_COST:
        fwd = ELEMENTWISE_COST[op] * float(numel(output))
        return fwd, fwd
    elif op in LOSS_COST:  # a scalar out of the logits: priced per input element
        fwd = LOSS_COST[op] * float(numel(inputs[0])) if inputs and inputs[0] else 0.0
        return fwd, fwd
    elif op in REDUCTION_OPS:
        fwd = float(numel(inputs[0])) if inputs and inputs[0] else float(numel(output))
        return fwd, fwd
    else:
        return None
    return fwd, 2.0 * fwd
