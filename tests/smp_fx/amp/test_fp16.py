"""fp16 and bf16 in one process (every stage in-process, pp=2): what needs no second rank.

The multi-process behaviour (agreement across ranks) is in ``test_precision_dist.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import smp_fx as smp
from tests.helpers.numerics import init, twin_models


def _step_fn(ex: Any) -> Any:
    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = ex.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    return train_step


def test_fp16_model_optimizer_and_checkpoint() -> None:
    init(2, 2, "interleaved", fp16=True)
    ex, ref, dm = twin_models("mlp")
    assert all(p.dtype == torch.float16 for p in dm.module.parameters())
    opt = smp.DistributedOptimizer(torch.optim.Adam(dm.parameters(), lr=1e-3),
                                   dynamic_loss_scale=True, init_scale=2.0**12)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    step = _step_fn(ex)
    x, y = ex.example_inputs(8)[0], ex.example_targets(8)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = step(dm, x, y).reduce_mean()
        assert loss.dtype == torch.float32  # FP16_Module: fp32 outputs, fp32 loss
        ex.loss_fn(ref(x), y).backward()
        norm = opt.clip_master_grads(1e9)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        assert math.isclose(float(norm), float(want), rel_tol=1e-2)
        opt.step()
        ref_opt.step()
        assert not opt.overflow
    assert opt.loss_scale == 2.0**12  # no overflow within the default 1000-step window
    masters = {n: m.detach().clone() for (n, _), (_, m) in
               zip(dm.local_named_parameters(), opt._masters.pairs)}
    sd = opt.local_state_dict()
    assert all(sd["state"][n]["fp32_master"].dtype == torch.float32 for n in masters)
    assert sd["param_groups"][0]["loss_scaler"]["cur_scale"] == 2.0**12
    with torch.no_grad():
        for _, m in opt._masters.pairs:
            m.zero_()
    opt.load_state_dict(sd)
    for (n, _), (_, m) in zip(dm.local_named_parameters(), opt._masters.pairs):
        assert torch.equal(m, masters[n]), n
    assert all("fp32_master" not in st for st in opt.optimizer.state.values())


def test_default_scale_overflows_fp16_until_it_fits() -> None:
    init(2, 1, "simple", fp16=True)
    ex, _, dm = twin_models("mlp")
    opt = smp.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1),
                                   static_loss_scale=None, dynamic_loss_scale=True)
    before = [p.detach().clone() for p in dm.module.parameters()]
    step = _step_fn(ex)
    x, y = ex.example_inputs(4)[0], ex.example_targets(4)
    skipped = 0
    while True:
        opt.zero_grad()
        step(dm, x, y)
        opt.step()
        if not opt.overflow:
            break
        skipped += 1
        assert all(torch.equal(a, b) for a, b in zip(before, dm.module.parameters()))
    assert skipped > 0 and opt.loss_scale == 2.0**32 / 2**skipped


def test_bf16_configuration_trains_bf16_weights_with_fp32_masters() -> None:
    """``"bf16": true`` (SMP 1.11+): bf16 weights, fp32 outputs and masters, no loss
    scaling (the loss-scaling arguments the script passes are unused); it follows the fp32
    model to bf16's precision."""
    init(2, 2, "interleaved", bf16=True)
    ex, ref, dm = twin_models("mlp")
    assert all(p.dtype == torch.bfloat16 for p in dm.module.parameters())
    opt = smp.DistributedOptimizer(torch.optim.Adam(dm.parameters(), lr=1e-3),
                                   static_loss_scale=None, dynamic_loss_scale=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    step = _step_fn(ex)
    x, y = ex.example_inputs(8)[0], ex.example_targets(8)
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = step(dm, x, y).reduce_mean()
        assert loss.dtype == torch.float32 and dm.loss_scale == 1.0
        want = ex.loss_fn(ref(x), y)
        want.backward()
        assert math.isclose(float(loss), float(want.detach()), rel_tol=2e-2)
        opt.step()
        ref_opt.step()
    assert all(m.dtype == torch.float32 for _, m in opt._masters.pairs)
    for (_, p), (_, m) in zip(dm.local_named_parameters(), opt._masters.pairs):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_bf16_autocast_reaches_the_plan() -> None:
    shapes = {}
    for dtype in (None, torch.bfloat16):
        init(2, 1, "simple")
        ex, _, dm = twin_models("mlp")
        step = _step_fn(ex)
        x, y = ex.example_inputs(4)[0], ex.example_targets(4)
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            step(dm, x, y)
        sent = dm.plan.to_json()["stages"][0]["sent"][0]
        shapes[dtype] = (sent["dtype"], dm.plan.stages[0].memory.activations_per_microbatch)
    assert shapes[None][0] == "float32" and shapes[torch.bfloat16][0] == "bfloat16"
    assert shapes[torch.bfloat16][1] < shapes[None][1]


def test_grad_scaler_in_one_process_is_torchs() -> None:
    init(2, 1, "simple")
    ex, ref, dm = twin_models("mlp")
    opt = smp.DistributedOptimizer(torch.optim.SGD(dm.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = smp.amp.GradScaler(init_scale=4.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        model.backward(scaler.scale(ex.loss_fn(model(x), y)))

    x, y = ex.example_inputs(4)[0], ex.example_targets(4)
    step(dm, x, y)
    ref_scaler.scale(ex.loss_fn(ref(x), y)).backward()
    for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
        s.step(o)
        s.update()
    assert scaler.get_scale() == ref_scaler.get_scale()
    for (n, p), q in zip(dm.local_named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=n)
