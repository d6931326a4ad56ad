"""FusedAdam against torch's Adam / AdamW (with bias correction) and apex's update written
out in float64 (without it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import smp_fx as smp
from smp_fx.optimizers import FusedAdam


def _grads(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(3, 4, generator=g) for _ in range(steps)]


@pytest.mark.parametrize(("adam_w", "wd"), [(True, 0.0), (True, 0.1), (False, 0.1)])
def test_equals_torch_adam_with_bias_correction(adam_w: bool, wd: float) -> None:
    start = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours = FusedAdam([a], lr=0.01, weight_decay=wd, adam_w_mode=adam_w)
    kind = torch.optim.AdamW if adam_w else torch.optim.Adam
    theirs = kind([b], lr=0.01, weight_decay=wd)
    for g in _grads(4):
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_without_bias_correction_is_apexs_update() -> None:
    p = torch.nn.Parameter(torch.ones(3, 4))
    opt = FusedAdam([p], lr=0.1, bias_correction=False, weight_decay=0.01, betas=(0.8, 0.9))
    ref = np.ones((3, 4))
    m, v = np.zeros_like(ref), np.zeros_like(ref)
    for g in _grads(3):
        p.grad = g.clone()
        opt.step()
        gn = g.double().numpy()
        m = 0.8 * m + 0.2 * gn
        v = 0.9 * v + 0.1 * gn * gn
        ref = ref - 0.1 * (m / (np.sqrt(v) + 1e-8) + 0.01 * ref)
    torch.testing.assert_close(p.detach().double(), torch.from_numpy(ref), atol=1e-6,
                               rtol=1e-5)
    assert opt.param_groups[0]["step"] == 3


def test_apex_signature_and_zero_grad() -> None:
    assert smp.optimizers.FusedAdam is FusedAdam
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    FusedAdam([p]).zero_grad()
    assert p.grad is None  # set_grad_none
    p.grad = torch.ones(2)
    FusedAdam([p], set_grad_none=False).zero_grad()
    assert p.grad is not None and not p.grad.any()
    with pytest.raises(smp.SMPError, match="AMSGrad"):
        FusedAdam([p], amsgrad=True)
