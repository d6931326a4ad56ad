"""FusedLamb against apex's LAMB written out element by element in float64 (numpy)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from smp_fx.optimizers import FusedLamb


def _reference(params: list[np.ndarray], grads: list[list[np.ndarray]], lr: float,
               betas: tuple[float, float], eps: float, wd: float, adam_w: bool,
               averaging: bool, max_norm: float, nvlamb: bool) -> list[np.ndarray]:
    """apex multi_tensor_lamb stage 1 and 2, one element at a time."""
    b1, b2 = betas
    b3 = 1 - b1 if averaging else 1.0
    ps = [p.astype(np.float64).copy() for p in params]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    for step, gs in enumerate(grads, start=1):
        norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in gs))
        clip = norm / max_norm if norm > max_norm else 1.0
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        for p, m, v, g in zip(ps, ms, vs, gs):
            update = np.zeros_like(p)
            for i in np.ndindex(p.shape):
                sg = g[i] / clip
                if not adam_w:
                    sg = sg + wd * p[i]
                m[i] = m[i] * b1 + b3 * sg
                v[i] = v[i] * b2 + (1 - b2) * sg * sg
                u = (m[i] / bc1) / (math.sqrt(v[i] / bc2) + eps)
                update[i] = u + wd * p[i] if adam_w else u
            ratio = lr
            if nvlamb or wd != 0:
                pn, un = np.linalg.norm(p), np.linalg.norm(update)
                ratio = lr * pn / un if pn != 0 and un != 0 else lr
            p -= ratio * update
    return ps


@pytest.mark.parametrize(("adam_w", "averaging", "nvlamb", "wd", "max_norm"), [
    (True, True, False, 0.01, 1.0), (False, True, False, 0.1, 0.5),
    (True, False, True, 0.0, 10.0), (True, True, False, 0.0, 0.3)])
def test_matches_apex_algorithm(adam_w: bool, averaging: bool, nvlamb: bool, wd: float,
                                max_norm: float) -> None:
    torch.manual_seed(0)
    params = [torch.randn(3, 4), torch.randn(5)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    live = [torch.nn.Parameter(p.clone()) for p in params]
    opt = FusedLamb(live, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd,
                    adam_w_mode=adam_w, grad_averaging=averaging, max_grad_norm=max_norm,
                    use_nvlamb=nvlamb)
    for gs in grads:
        for p, g in zip(live, gs):
            p.grad = g.clone()
        opt.step()
    want = _reference([p.numpy() for p in params], [[g.numpy() for g in gs] for gs in grads],
                      0.01, (0.8, 0.95), 1e-6, wd, adam_w, averaging, max_norm, nvlamb)
    for got, ref in zip(live, want):
        torch.testing.assert_close(got.detach().double(), torch.from_numpy(ref),
                                   atol=1e-6, rtol=1e-5)
    assert opt.param_groups[0]["step"] == 3


def test_signature_grad_norm_hook_and_zero_grad() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = FusedLamb([p], max_grad_norm=1.0)
    seen = []
    opt.set_grad_norm_fn(lambda ps: seen.append(len(ps)) or torch.tensor(100.0))
    p.grad = torch.ones(4)
    opt.step()  # the hook's norm (100 > 1) scales the gradient by 1/100
    assert seen == [1] and opt.state[p]["exp_avg"][0].item() == pytest.approx(0.1 * 0.01)
    opt.zero_grad()
    assert p.grad is None
    with pytest.raises(Exception, match="AMSGrad"):
        FusedLamb([p], amsgrad=True)
    assert list(itertools.islice(FusedLamb([p]).defaults, 3)) == ["lr", "bias_correction",
                                                                    "betas"]
