"""What the context-parallel rewrite refuses: ops that would compute wrongly on a chunk.

A local value holds this rank's tokens only. An op that mixes tokens along the sequence of
such a value (a softmax, a sort, a cumulative op, a slice, a matmul or a convolution over
it, a reduction that leaves a partial result, attention written as matmul-softmax-matmul)
would give each rank a different, wrong answer; ``refusal`` names the reason.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.fx

from passes.context_parallel.dims import (
    SDPA,
    is_tensor,
    mentions,
    name_of,
    seq_dims,
    tensor_inputs,
    val_of,
)

aten = torch.ops.aten
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


def refusal(node: torch.fx.Node, local: Collection[torch.fx.Node], seq: Any) -> str | None:
    """Why computing ``node`` on local tokens would be wrong (``local``: the values that
    hold local tokens; ``seq``: the length's symbol), or None."""
    target = node.target
    local_in = [a for a in tensor_inputs(node) if a in local]
    if target in SDPA:
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        local_mask = isinstance(mask, torch.fx.Node) and mask in local
        return "its mask is computed from local tokens" if local_mask else None
    dims = [seq_dims(a, seq) for a in local_in]
    if target in DIM_OPS and len(node.args) > 1:
        dim_arg = node.args[1]
        wanted = dim_arg if isinstance(dim_arg, (list, tuple)) else [dim_arg]
        src = node.args[0]
        rank = val_of(src).dim() if is_tensor(src) else 0
        if any(isinstance(d, int) and rank and d % rank in seq_dims(src, seq) for d in wanted):
            return f"{name_of(target)} along the sequence of a chunk"
    if target is aten.slice.Tensor and node.args[0] in local:
        dim: Any = node.args[1] if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        whole = start in (0, None) and (end is None or isinstance(end, int) and end >= 2**62)
        if dim % val_of(node.args[0]).dim() in seq_dims(node.args[0], seq) and not whole:
            return "a slice of the sequence of a chunk"
    if target in MATMULS and local_in:
        a = node.args[-2] if target is aten.baddbmm.default else node.args[0]
        if is_tensor(a) and val_of(a).dim() - 1 in seq_dims(a, seq):
            return ("a matmul contracting the sequence (attention not written as "
                    "scaled_dot_product_attention)")
    if target in CONVOLUTIONS and any(d and max(d) >= 2 for d in dims):
        return "a convolution along the sequence"
    if target is aten.cat.default:
        return _cat(node, local, seq)
    if is_tensor(node) and any(dims) and not mentions(node, seq):
        return (f"{name_of(target)} reduces over the sequence of a chunk (each rank would "
                "hold a partial result)")
    if len(seq_dims(node, seq)) > 1:
        return ("holds sequence x sequence values computed from a chunk (attention not "
                "written as scaled_dot_product_attention)")
    return None


def _cat(node: torch.fx.Node, local: Collection[torch.fx.Node], seq: Any) -> str | None:
    """A whole value concatenated to local ones along the sequence."""
    operands: Any = node.args[0]
    dim: Any = node.args[1] if len(node.args) > 1 else 0
    for p in (p for p in operands if isinstance(p, torch.fx.Node)):
        val = val_of(p)
        if p in local or not isinstance(val, torch.Tensor):
            continue
        empty = not isinstance(val.numel(), torch.SymInt) and val.numel() == 0
        if not empty and val.dim() and dim % val.dim() in seq_dims(node, seq):
            return "concatenates whole and local values along the sequence"
    return None


__all__ = ["refusal"]
