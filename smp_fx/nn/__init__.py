"""``smp.nn``: SMP's modules. Names documented by SMP but not built yet raise
``SMPNotImplementedError`` on access (``smp_fx.namespaces``); built ones are plain
attributes of this package."""

from __future__ import annotations

from typing import Any

from smp_fx.namespaces import planned
from smp_fx.nn import huggingface
from smp_fx.nn.attention import DistributedAttentionLayer, DistributedTransformerOutputLayer
from smp_fx.nn.embedding import DistributedEmbedding
from smp_fx.nn.flash_attention import FlashAttentionLayer
from smp_fx.nn.fused_layer_norm import FusedLayerNorm
from smp_fx.nn.linear import DistributedLinear
from smp_fx.nn.transformer import (
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
)

__all__ = ["DistributedAttentionLayer", "DistributedEmbedding", "DistributedLinear",
           "DistributedTransformer", "DistributedTransformerLMHead",
           "DistributedTransformerLayer", "DistributedTransformerOutputLayer",
           "FlashAttentionLayer", "FusedLayerNorm", "huggingface"]

PLANNED: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    planned("smp.nn", name, PLANNED)
