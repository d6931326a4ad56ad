"""``smp.nn.FusedLayerNorm``: apex's ``FusedLayerNorm`` signature on torch's layer norm.

SMP cannot run apex's CUDA extension modules and offers this replacement; so does smp-fx,
in plain torch: ``torch.nn.functional.layer_norm`` is fused on GPU already, and the module
traces and partitions like any other. apex's arguments are kept: ``normalized_shape``,
``eps``, ``elementwise_affine`` (weight ones, bias zeros) and ``memory_efficient``, which
in apex saves the output instead of the input for backward; here it is accepted and has
no effect on the numbers (torch's kernel saves what it saves).

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
