"""``smp.nn.FlashAttentionLayer`` computes attention as SMP's page defines it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import smp_fx as smp


def test_matches_scaled_dot_product_attention() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3, 4, 8)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    layer = smp.nn.FlashAttentionLayer(attention_head_size=8).eval()
    for causal in (False, True):
        torch.testing.assert_close(layer(qkv, causal=causal),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def test_scales_and_an_alibi_mask() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(1, 4, 3, 2, 8)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    by_layer = smp.nn.FlashAttentionLayer(0.0, attention_head_size=8,
                                          scale_attn_by_layer_idx=True, layer_idx=3)
    assert by_layer.scale == pytest.approx(1 / (math.sqrt(8) * 4))
    assert smp.nn.FlashAttentionLayer(scale=0.5, attention_head_size=8).scale == 0.5
    assert smp.nn.FlashAttentionLayer(scale_attention_scores=False).scale == 1.0
    slopes = torch.tensor([0.5, 0.25]).view(1, 2, 1, 1)  # ALiBi: one slope per head
    mask = slopes * torch.arange(-3.0, 1.0).view(1, 1, 1, 4)
    mask[..., 0] = float("-inf")  # the first key masked
    alibi = smp.nn.FlashAttentionLayer(0.0, attention_head_size=8, use_alibi=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(alibi(qkv, attn_mask=mask), want)
    with pytest.raises(smp.SMPConfigError, match="attention_head_size"):
        smp.nn.FlashAttentionLayer()
