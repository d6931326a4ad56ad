"""``smp.hvd_average_grads()``: the replicas' gradients become their mean."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_ranks


def _replica() -> dict[str, Any]:
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": 1, "ddp": False})
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).pow(2).sum()
        model.backward(loss)
        return loss

    torch.manual_seed(1)
    xs = torch.randn(2, 4, 3)
    train_step(model, xs[smp.rank()])  # each replica its own batch: different gradients
    assert net.weight.grad is not None
    before = net.weight.grad.tolist()
    smp.hvd_average_grads()
    return {"before": before, "after": net.weight.grad.tolist(), "m": smp.num_microbatches()}


@pytest.mark.multiproc
def test_hvd_average_grads_averages_over_the_replicas() -> None:
    results = run_ranks(_replica, 2, timeout=120)
    before = [torch.tensor(r["before"]) for r in results]
    assert not torch.equal(before[0], before[1])
    for r in results:
        torch.testing.assert_close(torch.tensor(r["after"]), (before[0] + before[1]) / 2)
        assert r["m"] == 1


def test_hvd_average_grads_needs_a_model() -> None:
    import smp_fx as smp
    from smp_fx.world import context, state

    smp.init({"pipeline_parallel_degree": 1})
    try:
        context.clear_current_model()
        with pytest.raises(smp.SMPRuntimeError, match="smp.DistributedModel"):
            smp.hvd_average_grads()
    finally:
        state._reset()
