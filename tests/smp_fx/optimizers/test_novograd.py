"""FusedNovoGrad against apex's NovoGrad written out element by element in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from smp_fx.optimizers import FusedNovoGrad


def _reference(params: list[np.ndarray], grads: list[list[np.ndarray]], lr: float,
               betas: tuple[float, float], eps: float, wd: float, inside: bool,
               averaging: bool, norm_type: int, init_zero: bool) -> list[np.ndarray]:
    """apex multi_tensor_novograd (per-tensor norm blend, then the element update)."""
    b1, b2 = betas
    b3 = 1 - b1 if averaging else 1.0
    ps = [p.astype(np.float64).copy() for p in params]
    ms = [np.zeros_like(p) for p in ps]
    vs: list[float] = []
    for step, gs in enumerate(grads, start=1):
        norms = [float(np.sqrt((g.astype(np.float64) ** 2).sum())) if norm_type == 2
                 else float(np.abs(g).max()) for g in gs]
        if step == 1:
            vs = [0.0] * len(gs) if init_zero else list(norms)
        for k, n in enumerate(norms):
            vs[k] = (math.sqrt(b2 * vs[k] ** 2 + (1 - b2) * n * n) if norm_type == 2
                     else b2 * vs[k] + (1 - b2) * n)
        bc1, bc2 = 1 - b1**step, math.sqrt(1 - b2**step)
        for p, m, v, g in zip(ps, ms, vs, gs):
            denom = v / bc2 + eps
            for i in np.ndindex(p.shape):
                if inside:
                    gi = g[i] / denom + wd * p[i]
                    m[i] = b1 * m[i] + b3 * gi
                    p[i] = p[i] - lr * m[i] / bc1
                else:
                    m[i] = b1 * m[i] + b3 * g[i]
                    p[i] = p[i] - lr * ((m[i] / bc1) / denom + wd * p[i])
    return ps


@pytest.mark.parametrize(("inside", "averaging", "norm_type", "init_zero", "wd"), [
    (False, True, 2, False, 0.0), (True, True, 2, False, 0.01),
    (False, False, 0, True, 0.05), (True, False, 0, False, 0.0)])
def test_matches_apex_algorithm(inside: bool, averaging: bool, norm_type: int,
                                init_zero: bool, wd: float) -> None:
    torch.manual_seed(0)
    params = [torch.randn(3, 4), torch.randn(6)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    live = [torch.nn.Parameter(p.clone()) for p in params]
    opt = FusedNovoGrad(live, lr=0.01, betas=(0.9, 0.98), eps=1e-8, weight_decay=wd,
                        reg_inside_moment=inside, grad_averaging=averaging,
                        norm_type=norm_type, init_zero=init_zero)
    for gs in grads:
        for p, g in zip(live, gs):
            p.grad = g.clone()
        opt.step()
    want = _reference([p.numpy() for p in params], [[g.numpy() for g in gs] for gs in grads],
                      0.01, (0.9, 0.98), 1e-8, wd, inside, averaging, norm_type, init_zero)
    for got, ref in zip(live, want):
        torch.testing.assert_close(got.detach().double(), torch.from_numpy(ref),
                                   atol=1e-6, rtol=1e-5)


def test_rejects_what_apex_rejects() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(Exception, match="AMSGrad"):
        FusedNovoGrad([p], amsgrad=True)
    with pytest.raises(Exception, match="norm"):
        FusedNovoGrad([p], norm_type=1)
