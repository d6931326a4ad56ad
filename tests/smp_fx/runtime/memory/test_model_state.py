"""The runtime holds what the memory model counts: at pp 2 x dp 2 with ``fp16`` and
``shard_optimizer_state`` (4 gloo ranks, one Adam step), each rank's parameters, their
gradients and its optimizer's tensors (fp32 masters, their gradients, Adam's moments and
step counters) weigh, byte for byte, what its stage's plan says
(``cost_model.memory.model_state``, the planner's count)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_ranks

Bytes = tuple[int, int, int]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _measure() -> tuple[Bytes, Bytes]:
    """(measured, planned) (params, grads, optimizer) bytes on this rank."""
    import smp_fx as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True, "fp16": True,
              "shard_optimizer_state": True})
    torch.manual_seed(0)  # four equal layers: each stage's two weights split evenly
    dm = smp.DistributedModel(nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)]))
    opt = smp.DistributedOptimizer(torch.optim.Adam(dm.parameters(), lr=1e-3))

    @smp.step
    def train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).float().pow(2).mean()
        model.backward(loss)
        return loss

    train_step(dm, torch.randn(4, 8))
    opt.step()
    params = [p for _, p in dm.local_named_parameters()]
    own = {id(p) for p in params}
    held = [q for g in opt.torch_optimizer.param_groups for q in g["params"]]
    optimizer = sum(_nbytes(q) + (_nbytes(q.grad) if q.grad is not None else 0)
                    for q in held if id(q) not in own)
    optimizer += sum(_nbytes(v) for q in held for v in opt.torch_optimizer.state[q].values()
                     if isinstance(v, torch.Tensor))
    measured = (sum(map(_nbytes, params)),
                sum(_nbytes(p.grad) for p in params if p.grad is not None), optimizer)
    assert dm.plan is not None
    stage = dm.plan.stages[smp.pp_rank()].memory
    return measured, (stage.params, stage.grads, stage.optimizer_state)


@pytest.mark.multiproc
def test_measured_state_equals_the_model_at_pp2_dp2_fp16_zero1() -> None:
    results = run_ranks(_measure, 4, timeout=300)
    for rank, (measured, planned) in enumerate(results):
        assert measured == planned, (rank, measured, planned)
    # two weights of 8 x 8 per stage: half precision, and each rank's optimizer one of them
    assert results[0][0] == (2 * 64 * 2, 2 * 64 * 2, 64 * 16 + 4)
