"""Every schedule equals one process on the global batch: the numerics grid.

Every schedule (``simple``, ``interleaved``, ``zero_bubble`` at v = 1 and 2, ``zbv`` at 2)
x pp {2, 4} x microbatches {4, 8}: 3 Adam steps of a tiny MLP, the loss and every gradient
after every step and every parameter after the last within 1e-5 of the unpartitioned model
trained in one process on the global batch. In one process (every chunk here), and across
processes (one launch per pipeline degree runs all of its cases in turn), where every
rank runs its steps after the first straight through (``smp_fx.runtime.executor.straight``:
no step-function thread started).
``active_microbatches`` caps the warm-up of the schedules that take one; the numbers stay
the same.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import smp_fx as smp
from smp_fx.world import state
from tests.helpers.dist import run_ranks

SCHEDULES = (("simple", 1), ("interleaved", 1), ("zero_bubble", 1), ("simple", 2),
             ("interleaved", 2), ("zero_bubble", 2), ("zbv", 2))
GRID = [(name, v, m) for name, v in SCHEDULES for m in (4, 8)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(8)],
                         nn.Linear(8, 3))


def _case(pp: int, name: str, v: int, m: int, **extra: Any) -> list[str]:
    """Train both ways; the mismatches (none expected)."""
    state._reset()
    smp.init({"pipeline_parallel_degree": pp, "microbatches": m, "pipeline": name,
              "virtual_pipeline_degree": v, **extra})
    ref, model = _model(), smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    tag = f"pp={pp} {name} v={v} m={m} {extra or ''}"
    bad: list[str] = []
    conductor, threads = None, 0
    for step in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        if dist.is_initialized() and step == 0:
            conductor = model.executor.conductor
            threads = conductor.threads_started
        want_loss = F.cross_entropy(ref(x), y)
        want_loss.backward()
        bad += [f"{tag}: loss step {step}"] * (not torch.allclose(loss, want_loss, atol=1e-5))
        want = dict(ref.named_parameters())
        bad += [f"{tag}: grad {n} step {step}" for n, p in model.local_named_parameters()
                if not torch.allclose(p.grad, want[n].grad, rtol=0, atol=1e-5)]
        opt.step()
        ref_opt.step()
    want = dict(ref.named_parameters())
    bad += [f"{tag}: param {n}" for n, p in model.local_named_parameters()
            if not torch.allclose(p, want[n], rtol=0, atol=1e-5)]
    if conductor is not None:  # the first step learns the modes its forwards take
        straight = dist.get_world_size() > 1  # in one process: no peers, threaded
        got = (conductor.straight_steps, conductor.threads_started - threads)
        if got != ((2, 0) if straight else (0, got[1])):
            bad.append(f"{tag}: rank {smp.pp_rank()} straight steps, threads {got}")
    return bad


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize(("name", "v"), SCHEDULES)
def test_in_one_process(name: str, v: int, pp: int) -> None:
    try:
        bad = _case(pp, name, v, 4) + _case(pp, name, v, 8)
    finally:
        state._reset()
    assert bad == []


def test_active_microbatches_caps_without_changing_numbers() -> None:
    try:
        bad = (_case(4, "zero_bubble", 1, 8, active_microbatches=2)
               + _case(2, "simple", 2, 8, active_microbatches=3))
    finally:
        state._reset()
    assert bad == []


def _all_cases(pp: int) -> list[str]:
    dist.init_process_group("gloo")
    try:
        return [b for name, v, m in GRID for b in _case(pp, name, v, m)]
    finally:
        state._reset()


@pytest.mark.multiproc
@pytest.mark.usefixtures("check_order")  # NCCL's ordering rule too (docs/runtime.md)
@pytest.mark.parametrize("pp", [2, 4])
def test_across_processes(pp: int) -> None:
    assert run_ranks(_all_cases, pp, pp, timeout=300) == [[]] * pp
