"""``smp.nn``: SMP's modules. Names documented by SMP but not built yet raise
``SMPNotImplementedError`` on access (``smp_fx.namespaces``); built ones are plain
attributes of this package."""

from __future__ import annotations

from typing import Any

from smp_fx.namespaces import planned
from smp_fx.nn.embedding import DistributedEmbedding
from smp_fx.nn.fused_layer_norm import FusedLayerNorm
from smp_fx.nn.linear import DistributedLinear

__all__ = ["DistributedEmbedding", "DistributedLinear", "FusedLayerNorm"]

PLANNED: dict[str, str] = {
    "DistributedTransformerLMHead": "tensor-parallel transformer with LM head",
    "DistributedTransformer": "tensor-parallel transformer",
    "DistributedTransformerLayer": "tensor-parallel transformer layer",
    "DistributedAttentionLayer": "tensor-parallel attention layer",
    "DistributedTransformerOutputLayer": "tensor-parallel transformer output layer",
}


def __getattr__(name: str) -> Any:
    planned("smp.nn", name, PLANNED)
