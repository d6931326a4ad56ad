"""``smp.nn.FusedLayerNorm``: apex's ``FusedLayerNorm`` signature on torch's layer norm.

torch's layer norm is fused on GPU already and traces like any module; apex's
``memory_efficient`` is accepted without effect on the numbers. See docs/precision.md,
'apex replacements'.

>>> import torch
>>> ln = FusedLayerNorm(4)
>>> ln(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).sum().abs().item() < 1e-6
True
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


class FusedLayerNorm(nn.LayerNorm):
    """Layer normalisation with ``apex.normalization.FusedLayerNorm``'s signature."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, memory_efficient: bool = False) -> None:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) \
            else tuple(normalized_shape)
        super().__init__(shape, eps=eps, elementwise_affine=elementwise_affine)
        self.memory_efficient = memory_efficient

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, memory_efficient={self.memory_efficient}"
