"""``smp.nn.FlashAttentionLayer``: SMP 1.13+'s attention core over a packed ``qkv``.

The function SMP's FlashAttention kernels compute, in plain torch, with the scale composed
as SMP's page says; with ``triton_flash_attention`` no dropout, as SMP's Triton kernel.
No parameters, so tensor parallelism has nothing of it to split.
See docs/tensor_parallel.md, 'API'.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cost_model.errors import SMPConfigError


class FlashAttentionLayer(nn.Module):
    """See the module docstring (SMP's parameters, in SMP's order)."""

    def __init__(self, attention_dropout_prob: float = 0.1,
                 attention_head_size: int | None = None, scale_attention_scores: bool = True,
                 scale_attn_by_layer_idx: bool = False, layer_idx: int | None = None,
                 scale: float | None = None, triton_flash_attention: bool = False,
                 use_alibi: bool = False) -> None:
        super().__init__()
        if scale is None:
            scale = 1.0
            if scale_attention_scores:
                if attention_head_size is None:
                    raise SMPConfigError.build(
                        "scale_attention_scores needs attention_head_size", None,
                        "smp.nn.FlashAttentionLayer", "pass attention_head_size (or scale)")
                scale /= math.sqrt(attention_head_size)
            if scale_attn_by_layer_idx:
                if layer_idx is None:
                    raise SMPConfigError.build(
                        "scale_attn_by_layer_idx needs layer_idx", None,
                        "smp.nn.FlashAttentionLayer", "pass layer_idx (or scale)")
                scale /= layer_idx + 1
        self.scale = float(scale)
        self.use_alibi = use_alibi
        self.triton_flash_attention = triton_flash_attention
        self.attention_dropout = nn.Dropout(0.0 if triton_flash_attention
                                            else attention_dropout_prob)

    def forward(self, qkv: torch.Tensor, attn_mask: torch.Tensor | None = None,
                causal: bool = False) -> torch.Tensor:
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise SMPConfigError.build(
                "qkv must be [batch, seq, 3, heads, head_size]", tuple(qkv.shape),
                "smp.nn.FlashAttentionLayer.forward", "stack query, key and value on dim 2")
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [N, heads, S, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if attn_mask is not None:
            scores = scores + attn_mask.to(scores.dtype)
        if causal:
            s = scores.shape[-1]
            upper = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(upper, float("-inf"))
        probs = self.attention_dropout(torch.softmax(scores, dim=-1))
        return torch.matmul(probs, v)


__all__ = ["FlashAttentionLayer"]
