"""``smp.nn.DistributedLinear``: a linear layer that tensor parallelism distributes.

An ``nn.Linear`` marked for tensor parallelism, global sizes; the rewrite pairs it or
gathers its output, so it is replicated on every tp rank like the plain layer's.
"""

from __future__ import annotations

import torch
from torch import nn

from smp_fx.marking.tensor_parallelism import mark


class DistributedLinear(nn.Linear):
    """``nn.Linear(in_features, out_features, bias)`` distributed over the tp group."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        mark(self)
