"""What autograd saves for backward, per canonical op: the activation-memory model.

A rule names which values an op keeps rather than bytes, so a tensor saved by two ops
counts once and views map to their storage, as in autograd. Rules follow PyTorch's
``tools/autograd/derivatives.yaml``; parameters never count. See docs/memory.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cost_model.flops import (
    CREATION_OPS,
    LOSS_COST,
    REDUCTION_OPS,
    VIEW_OPS,
    MaybeShape,
    numel,
)

SAVES_OUTPUT = frozenset({"relu", "sigmoid", "tanh", "softmax", "log_softmax", "exp", "sqrt",
                          "rsqrt", "hardtanh"})
SAVES_INPUT = frozenset({"gelu", "silu", "pow", "abs", "log", "erf", "leaky_relu", "clamp",
                         "adaptive_avg_pool", "avg_pool", "max_pool", "sin", "cos"})
SAVES_INDEX = frozenset({"gather", "index_select"})
"""Ops whose backward scatters by their index tensor (their second tensor input), kept;
autograd's ``gather`` keeps its input too (derivatives.yaml passes ``self``, not its
sizes)."""
SAVES_INDICES = frozenset({"topk", "sort"})
"""Ops returning (values, indices) whose backward scatters by the indices, kept."""
SAVES_NOTHING = (frozenset({"add", "sub", "neg", "rsub", "iadd", "sum", "mean", "cat",
                            "stack", "cumsum", "index"}) | VIEW_OPS | CREATION_OPS) \
    - SAVES_INDEX - SAVES_INDICES
BINARY_SAVES_OTHER = frozenset({"mul", "imul", "matmul", "mm", "bmm", "grouped_mm"})
"""Each operand is saved if the *other* one needs a gradient (d(ab)/da = b)."""


@dataclass(frozen=True)
class SavedRule:
    """Which values an op saves: tensor-input positions, its output, and extra bytes."""

    inputs: tuple[int, ...] = ()
    output: bool = False
    extra_bytes: int = 0
    output_items: tuple[int, ...] = ()
    """Positions of a tuple output saved (``max.dim``'s and ``topk``'s indices)."""


NOTHING = SavedRule()


def saved_rule(op: str, inputs: Sequence[MaybeShape], output: MaybeShape,
               attrs: Mapping[str, Any], inputs_require_grad: Sequence[bool],
               params_require_grad: bool) -> SavedRule | None:
    """The values ``op`` saves for backward; ``None`` if the op is unknown."""
    rg = list(inputs_require_grad) + [False] * (len(inputs) - len(inputs_require_grad))
    any_grad = any(rg) or params_require_grad
    if not any_grad or op in SAVES_NOTHING:
        return NOTHING if (op in SAVES_NOTHING or op in _KNOWN or op in REDUCTION_OPS
                           or op in SAVES_OUTPUT or op in SAVES_INPUT or op in SAVES_INDEX
                           or op in SAVES_INDICES
                           or op in BINARY_SAVES_OTHER) else None
    tensor = [i for i, s in enumerate(inputs) if s is not None]
    if op in SAVES_OUTPUT:
        return SavedRule(output=True)
    if op in SAVES_INPUT:
        extra = 8 * numel(output) if op == "max_pool" else 0  # int64 argmax indices
        return SavedRule(inputs=tuple(tensor[:1]), extra_bytes=extra)
    if op in ("linear", "conv"):
        weight_grad = params_require_grad or (len(rg) > 1 and rg[1])
        return SavedRule(inputs=(0,) if weight_grad and tensor[:1] == [0] else ())
    if op == "addmm":  # addmm(bias, x, W): saves x for W's gradient
        return SavedRule(inputs=(1,) if len(rg) > 2 and rg[2] else ())
    if op == "baddbmm":  # baddbmm(bias, a, b): a batched matmul's operands, as bmm's
        a, b = 1, 2
        return SavedRule(inputs=tuple(i for i, other in ((a, b), (b, a))
                                      if len(rg) > other and rg[other]))
    if op in BINARY_SAVES_OTHER:
        if len(tensor) < 2:  # tensor * scalar: the scalar is kept, not a tensor
            return NOTHING
        a, b = tensor[0], tensor[1]
        keep = tuple(i for i, other in ((a, b), (b, a)) if rg[other])
        return SavedRule(inputs=keep)
    if op in ("div", "truediv"):
        if len(tensor) < 2:
            return NOTHING
        a, b = tensor[0], tensor[1]
        keep = (b,) if not rg[b] else (a, b)
        return SavedRule(inputs=keep)
    if op in SAVES_INDICES or op in ("max", "min") and output is None:  # (values, indices)
        return SavedRule(output_items=(1,))
    if op in ("amax", "amin", "max", "min"):  # a whole reduction: the input and the result
        return SavedRule(inputs=tuple(tensor[:1]), output=True)
    if op in ("var", "std", "norm"):
        return SavedRule(inputs=tuple(tensor[:1]), output=op != "var")
    if op in SAVES_INDEX:
        return SavedRule(inputs=tuple(tensor[:2] if op == "gather" else tensor[1:2]))
    if op == "where":  # where(cond, a, b): the boolean condition
        return SavedRule(inputs=tuple(tensor[:1]))
    if op == "masked_fill":  # masked_fill(x, mask, value): the mask
        return SavedRule(inputs=tuple(tensor[1:2]))
    if op == "embedding":  # embedding(indices) as a module, or aten embedding(weight, idx)
        idx = attrs.get("indices_pos", 0)
        return SavedRule(inputs=(idx,) if params_require_grad or any(rg) else ())
    if op in ("layer_norm", "rms_norm", "group_norm"):
        norm_dims = int(attrs.get("norm_dims", 1))
        rows = numel(inputs[0][:-norm_dims]) if inputs[0] else 0
        if op == "group_norm" and inputs[0]:
            rows = inputs[0][0] * int(attrs.get("groups", 1))
        stats = 1 if op == "rms_norm" else 2
        return SavedRule(inputs=(0,), extra_bytes=4 * stats * rows)
    if op == "batch_norm":
        channels = inputs[0][1] if inputs[0] and len(inputs[0]) > 1 else 0
        training = bool(attrs.get("training", True))
        return SavedRule(inputs=(0,), extra_bytes=2 * 4 * channels if training else 0)
    if op == "dropout":  # the mask: bool in CUDA's fused kernel, the input's dtype on CPU
        p, training = float(attrs.get("p", 0.5)), bool(attrs.get("training", True))
        mask = int(attrs.get("mask_itemsize", 1))
        return SavedRule(extra_bytes=mask * numel(output) if training and p > 0 else 0)
    if op in LOSS_COST:  # the log-probabilities (nll_loss's input; cross-entropy's
        # log-softmax output, the logits' size and dtype), the targets, the total weight
        item = int(attrs.get("logits_itemsize", 4))
        if op == "nll_loss":
            return SavedRule(inputs=tuple(tensor[:2]), extra_bytes=item)
        logits = item * numel(inputs[0]) if inputs else 0
        if op == "tp_vocab_cross_entropy":  # softmax, column index (int64), two token masks
            tokens = numel(inputs[1]) if len(inputs) > 1 else 0
            return SavedRule(extra_bytes=logits + 10 * tokens)
        return SavedRule(inputs=tuple(tensor[1:2]), extra_bytes=logits + item)
    if op == "sdpa":  # CPU/flash kernels: q, k, v, output, log-sum-exp (fp32, B*H*L)
        q = inputs[0] or ()
        lse = 4 * math.prod(q[:-1]) if q else 0
        return SavedRule(inputs=tuple(tensor[:3]), output=True, extra_bytes=lse)
    return None


_KNOWN = frozenset({"linear", "conv", "addmm", "baddbmm", "div", "truediv", "where", "masked_fill",
                    "embedding", "layer_norm", "rms_norm", "group_norm", "batch_norm",
                    "dropout", "sdpa"}) | frozenset(LOSS_COST)
