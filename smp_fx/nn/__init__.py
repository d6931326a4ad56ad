"""``smp.nn``: modules SMP provides in place of ones it cannot run (apex)."""

from __future__ import annotations

from smp_fx.nn.fused_layer_norm import FusedLayerNorm

__all__ = ["FusedLayerNorm"]
