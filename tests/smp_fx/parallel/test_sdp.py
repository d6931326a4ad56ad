"""How sharded data parallelism cuts a stage into FSDP2 units (the training itself is in
``test_sharding_dist.py``)."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from smp_fx.parallel.sdp import plan_units


class _Shared(nn.Module):
    """Two linears, a third that reuses the first's weight, and a raw parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8, bias=False)
        self.c.weight = self.a.weight
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x))) * self.scale


def test_units_follow_the_bucket_size_and_persistence_threshold() -> None:
    seq = torch.fx.symbolic_trace(nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)]))
    plan = plan_units(seq, bucket=40, threshold=5)
    assert plan.units == (("0", "1"), ("2", "3"), ("4",))
    assert plan.unit_numels == (32, 32, 16) and plan.root_numel == 0
    assert plan.persistent == tuple(f"{i}.bias" for i in range(5))
    assert plan.live_numel == 64
    whole = plan_units(seq, bucket=10**9, threshold=0)
    assert whole.units == (("0", "1", "2", "3", "4"),) and whole.persistent == ()


def test_shared_and_raw_parameters_stay_in_the_root_unit() -> None:
    plan = plan_units(torch.fx.symbolic_trace(_Shared()), bucket=10**9, threshold=1)
    assert plan.units == (("b",),)
    assert plan.root_numel == 64 + 8 + 8  # a.weight (shared with c), a.bias, scale
    assert plan.live_numel == plan.root_numel + 72
