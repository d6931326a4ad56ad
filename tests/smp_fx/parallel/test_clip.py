"""Global gradient norms in one process (pp=2 in-process; GPT's tied weight is one object
there) and LAMB's global norm through DistributedOptimizer. Across processes, with the
tied weight replicated on two ranks: ``tests/smp_fx/amp/test_precision_dist.py``."""

from __future__ import annotations

import math

import pytest
import torch

import smp_fx as smp
from smp_fx.parallel.clip import NormScope, clip_grads
from tests.helpers.numerics import Pair, init


def test_norms_and_clipping_equal_the_unpartitioned_model() -> None:
    init(2, 2, "simple")
    pair = Pair("gpt")
    pair.compare(1, 2)  # leaves both models' gradients of one step
    for norm_type in (2.0, 1.0, math.inf, 3.0):
        got = pair.dm.clip_grad_norm_(math.inf, norm_type)
        want = torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), math.inf, norm_type)
        assert math.isclose(float(got), float(want), rel_tol=1e-6), norm_type
    pair.dm.clip_grad_norm_(0.01)
    torch.nn.utils.clip_grad_norm_(pair.ref.parameters(), 0.01)
    ref = dict(pair.ref.named_parameters())
    for n, p in pair.dm.local_named_parameters():
        torch.testing.assert_close(p.grad, ref[n].grad, atol=1e-8, rtol=1e-6)
    with pytest.raises(smp.SMPError, match="norm_type"):
        pair.dm.clip_grad_norm_(1.0, -1.0)


def test_counted_and_clipped_sets_differ() -> None:
    a, b = torch.full((3,), 4.0), torch.full((4,), 1.0)
    # b (a replica, say) scaled, not counted
    total = clip_grads(NormScope(), [a, b], [a], max_norm=1.0)
    assert math.isclose(float(total), math.sqrt(48.0), rel_tol=1e-6)
    assert math.isclose(float(b[0]), 1.0 / (math.sqrt(48.0) + 1e-6), rel_tol=1e-6)
    with pytest.raises(smp.SMPError, match="not finite"):
        clip_grads(NormScope(), [a], [torch.tensor([math.nan])], 1.0, error_if_nonfinite=True)


def test_lamb_in_a_distributed_optimizer_clips_by_the_whole_models_norm() -> None:
    init(2, 2, "simple")
    pair = Pair("mlp")
    opt = smp.DistributedOptimizer(smp.optimizers.FusedLamb(
        pair.dm.module.parameters(), lr=0.01, max_grad_norm=0.05))
    ref_opt = smp.optimizers.FusedLamb(pair.ref.parameters(), lr=0.01, max_grad_norm=0.05)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        pair.train_step(pair.dm, *pair.x, pair.y)
        pair.ref_step(2)
        opt.step()
        ref_opt.step()
    ref = dict(pair.ref.named_parameters())
    for n, p in pair.dm.local_named_parameters():
        torch.testing.assert_close(p, ref[n], atol=1e-6, rtol=1e-5, msg=n)
