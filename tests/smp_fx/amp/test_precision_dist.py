"""Precision and clipping across real processes: pp=2 x dp=2 on 4 gloo ranks.

One world goes through the configurations (each check names itself on failure):

* the global gradient norm (2, 1, inf) of the GPT example, whose embedding is tied to the
  LM head on the other stage, equals the unpartitioned model's ``clip_grad_norm_`` (rtol
  1e-6), and the clipped gradients equal the reference's;
* ``fp16``: 4 SGD steps with ``clip_master_grads`` track the fp32 reference (loss and
  parameters within ``FP16_TOL``; SGD, whose update is linear in the gradient, so the
  bound measures fp16 rounding and not Adam's sign flips on near-zero gradients); an inf
  injected into one rank's gradients makes every rank skip the step (parameters
  unchanged) and agree on the halved loss scale;
* ``smp.amp.GradScaler``: the same injection skips the step everywhere and leaves one
  scale; the next step is taken everywhere;
* ``smp.optimizers.FusedLamb`` in a DistributedOptimizer equals FusedLamb on the whole
  model: it clips by the global gradient norm;
* bf16 autocast around the step function: every step's loss equals the plain model's under
  the same autocast within ``BF16_TOL`` (a skipped optimizer step moves it by ~3e-2), and
  the stages really compute in bf16 (a dropped autocast moves the loss by only ~4e-5):
  every ``nn.Linear`` of this rank's stage returns bf16, the last stage's outputs (the
  logits) are bf16 and the first stage's have the dtypes its plan sends.

Every rank makes the same ``CHECKS`` checks.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.compare import Checks, mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.twin import Twin, agree, init, on_rank

FP16_TOL = 2e-3  # loss and parameters after 4 steps, fp16 weights vs the fp32 reference
# each step's loss against the plain model under bf16 autocast: bf16 gradients rounded in
# other orders (5e-6 seen on one CPU, 1.2e-4 on one with AMX, SGD alike), 30x under a
# skipped step's 3e-2
BF16_TOL = 1e-3
CHECKS = 21


def _poison(twin: Twin) -> None:
    """Make one local gradient inf (on the calling rank only)."""
    _, p = next(iter(twin.dm.local_named_parameters()))
    assert p.grad is not None
    p.grad.view(-1)[0] = math.inf


def _clip_checks(c: Checks) -> None:
    init(2, 2)
    t = Twin("gpt")
    t.smp_step()
    t.ref_step()
    for norm_type in (1.0, math.inf):  # max_norm inf: measure without clipping
        got = t.dm.clip_grad_norm_(math.inf, norm_type)
        want = torch.nn.utils.clip_grad_norm_(t.ref.parameters(), math.inf, norm_type)
        c.expect(math.isclose(float(got), float(want), rel_tol=1e-6), f"norm {norm_type}")
    got = t.dm.clip_grad_norm_(0.05)
    want = torch.nn.utils.clip_grad_norm_(t.ref.parameters(), 0.05)
    c.expect(math.isclose(float(got), float(want), rel_tol=1e-6), "norm 2")
    c.expect(not mismatched(t.local(grads=True), t.reference(grads=True), atol=1e-7),
             "clipped gradients")


def _fp16_checks(c: Checks) -> None:
    init(2, 2, fp16=True)
    t = Twin("gpt")
    opt = _fp16_optimizer(t)
    ref_opt = torch.optim.SGD(t.ref.parameters(), lr=0.1, momentum=0.9)
    worst = 0.0
    for _ in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = t.smp_step()
        ref_loss = t.ref_step()
        got, want = opt.clip_master_grads(1.0), torch.nn.utils.clip_grad_norm_(
            t.ref.parameters(), 1.0)
        c.expect(math.isclose(float(got), float(want), rel_tol=1e-2), "fp16 master norm")
        opt.step()
        ref_opt.step()
        worst = max(worst, abs(loss - ref_loss))
    c.expect(worst < FP16_TOL, f"fp16 loss within {FP16_TOL} (worst {worst:.2e})")
    c.expect(not mismatched(t.local(), t.reference(), atol=FP16_TOL), "fp16 parameters")
    before = {n: p.clone() for n, p in t.local().items() if p is not None}
    scale = opt.loss_scale
    opt.zero_grad()
    t.smp_step()
    on_rank(1, 0, lambda: _poison(t))
    c.expect(float(opt.clip_master_grads(1.0)) == -1.0, "fp16 overflow reported by clip")
    opt.step()
    c.expect(opt.overflow and opt.loss_scale == scale / 2, "fp16 overflow halves the scale")
    c.expect(agree(opt.loss_scale), "fp16 scale equal on every rank")
    c.expect(not mismatched(t.local(), before), "fp16 overflow step skipped")


def _fp16_optimizer(t: Twin) -> Any:
    import smp_fx as smp

    return smp.DistributedOptimizer(
        torch.optim.SGD(t.dm.parameters(), lr=0.1, momentum=0.9), static_loss_scale=None,
        dynamic_loss_scale=True,
        dynamic_loss_args={"init_scale": 2.0**12, "scale_window": 2})


def _grad_scaler_checks(c: Checks) -> None:
    import smp_fx as smp

    init(2, 2)
    t = Twin("mlp")
    opt = smp.DistributedOptimizer(torch.optim.SGD(t.dm.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler(init_scale=2.0**8)
    step = smp.step(lambda model, x, y: model.backward(scaler.scale(t.ex.loss_fn(model(x),
                                                                                   y))))
    step(t.dm, *t.x_local, t.y_local)
    before = {n: p.clone() for n, p in t.local().items() if p is not None}
    on_rank(1, 1, lambda: _poison(t))
    scaler.step(opt)
    scaler.update()
    c.expect(not mismatched(t.local(), before), "GradScaler: skipped on every rank")
    c.expect(scaler.get_scale() == 2.0**7 and agree(scaler.get_scale()),
             "GradScaler: one scale, backed off")
    opt.zero_grad()
    step(t.dm, *t.x_local, t.y_local)
    scaler.step(opt)
    scaler.update()
    c.expect(bool(mismatched(t.local(), before)), "GradScaler: the next step is taken")


def _lamb_checks(c: Checks) -> None:
    """FusedLamb clips by the global norm: each stage alone would see a part of it."""
    import smp_fx as smp

    t = Twin("mlp")
    opt = smp.DistributedOptimizer(smp.optimizers.FusedLamb(t.dm.parameters(), lr=0.01,
                                                            max_grad_norm=0.05))
    ref_opt = smp.optimizers.FusedLamb(t.ref.parameters(), lr=0.01, max_grad_norm=0.05)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        t.smp_step()
        t.ref_step()
        opt.step()
        ref_opt.step()
    c.expect(not mismatched(t.local(), t.reference(), atol=1e-6), "FusedLamb: global norm")


def _bf16_checks(c: Checks) -> None:
    import smp_fx as smp

    init(2, 2)
    t = Twin("gpt")
    opt = smp.DistributedOptimizer(torch.optim.Adam(t.dm.parameters(), lr=1e-3))
    ref_opt = torch.optim.Adam(t.ref.parameters(), lr=1e-3)
    worst = 0.0
    seen: dict[str, set[torch.dtype]] = {"linear": set(), "output": set()}
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        worst = max(worst, abs(t.smp_step(torch.bfloat16) - t.ref_step(torch.bfloat16)))
        if step == 0:  # the first step partitioned the model: watch this rank's stage
            _watch_dtypes(t.dm.program.stages[smp.pp_rank()].module, seen)
        opt.step()
        ref_opt.step()
    c.expect(worst < BF16_TOL, f"bf16 loss within {BF16_TOL} of plain autocast "
                               f"(worst {worst:.2e})")
    c.expect(seen["linear"] == {torch.bfloat16}, f"bf16: the stage's Linears ({seen})")
    s = smp.pp_rank()
    sent = {getattr(torch, v["dtype"]) for v in t.dm.plan.to_json()["stages"][s]["sent"]}
    want = {torch.bfloat16} if s == smp.pp_size() - 1 else sent
    c.expect(bool(want) and seen["output"] == want,
             f"bf16: stage {s} outputs {seen['output']}, want {want}")


def _watch_dtypes(stage: nn.Module, seen: dict[str, set[torch.dtype]]) -> None:
    """Record the dtypes of the tensors ``stage`` and each ``nn.Linear`` in it return."""
    def record(key: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            seen[key].update(o.dtype for o in outs if isinstance(o, torch.Tensor))
        return hook

    stage.register_forward_hook(record("output"))
    for m in stage.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(record("linear"))


def _body() -> tuple[int, list[str]]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    c = Checks()
    _clip_checks(c)
    _fp16_checks(c)
    _grad_scaler_checks(c)
    _lamb_checks(c)
    _bf16_checks(c)
    return c.report()


@pytest.mark.multiproc
def test_precision_on_pp2_dp2() -> None:
    for count, failed in run_ranks(_body, 4, timeout=300):
        assert count == CHECKS and not failed, (count, failed)
