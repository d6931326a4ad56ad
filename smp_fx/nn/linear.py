"""``smp.nn.DistributedLinear``: a linear layer that tensor parallelism distributes.

It is an ``nn.Linear`` (same arguments, same parameters, same function at tp=1) marked for
tensor parallelism. ``in_features`` and ``out_features`` are the global sizes. Under
``tensor_parallel_degree > 1`` the fx rewrite (``passes.tensor_parallel``) shards it: as
the first of a column -> row pair when an element-wise chain carries its output to another
distributed linear, otherwise column-parallel with its output all-gathered, so its output
is replicated on every tp rank like the plain layer's.
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
