"""The executor: order follows the schedule, memory follows the simulator, ranks agree on
every backward, and a stage that sends nothing still gets the outputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

import smp_fx as smp
from cost_model import schedule as sched
from cost_model.errors import SMPRuntimeError
from cost_model.simulate import StageCost, simulate
from passes import meta
from passes.split_stages import split_stages
from smp_fx.runtime.executor.lowering import Op, lower
from tests.helpers.compare import Checks, mismatched
from tests.helpers.numerics import init


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_saved_activations_in_flight_match_the_simulator(pipeline: str,
                                                         one_thread: None) -> None:
    p, m = 4, 8
    init(p, m, pipeline)
    model = smp.DistributedModel(nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)]))
    alive = [0] * p
    peak = [0] * p

    @smp.step
    def train(model: Any, x: torch.Tensor) -> Any:
        out = model(x)
        model.backward(out.sum())
        return out

    train(model, torch.randn(16, 4))  # partition
    # count microbatches whose forward state is alive on each stage, op by op
    ex = model.executor
    orig_f, orig_b = ex._op_f, ex._op_b

    def f(run: Any, op: Op) -> None:
        orig_f(run, op)
        alive[op.stage] += 1
        peak[op.stage] = max(peak[op.stage], alive[op.stage])

    def b(run: Any, op: Op) -> None:
        orig_b(run, op)
        alive[op.stage] -= 1

    ex._op_f, ex._op_b = f, b  # type: ignore[method-assign]
    train(model, torch.randn(16, 4))
    schedule = sched.generate(pipeline, p, m, m)
    predicted = simulate(schedule, [StageCost(1.0, 2.0)] * p).peak_in_flight
    expected = [m] * p if pipeline == "simple" else [min(p - s, m) for s in range(p)]
    assert peak == list(predicted) == expected
    assert [ex.stats.peak_in_flight[s] for s in range(p)] == expected


def _two_rank_model(microbatches: int, pipeline: str) -> Any:
    """On each of 2 gloo ranks: smp initialised, a 4-layer Linear model, seed 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    init(2, microbatches, pipeline)
    torch.manual_seed(0)
    return smp.DistributedModel(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]))


def _skip_body() -> tuple[int, list[str]]:
    """Runs on every rank: a grad-enabled step that skips some backwards (the last one
    included) ends with the right grads and no receive left posted (a gradient receive
    posted ahead regardless of the skip would be left open)."""
    import torch.distributed as dist

    model = _two_rank_model(4, "interleaved")

    @smp.step
    def train(model: Any, x: torch.Tensor, skip: bool) -> Any:
        out = model(x)
        if not (skip and x[0, 0] < 0):  # the same decision on every rank
            model.backward(out.sum())
        return out

    x = torch.ones(8, 4)
    x[2:4, 0] = x[6:8, 0] = -1.0  # microbatches 1 and 3 (the last)
    ok = Checks()
    grads = []
    for skip in (False, True, False):
        model.zero_grad()
        train(model, x, skip)
        grads.append([p.grad.clone() for p in model.local_parameters()])
    ok.expect(all(torch.equal(a, b) for a, b in zip(grads[0], grads[2])),
              "same grads before and after a step with skipped backwards")
    ok.expect(not all(torch.equal(a, b) for a, b in zip(grads[0], grads[1])),
              "skipped backwards change the grads")
    ok.expect(not model.executor.transport._posted, "no receive left posted")
    dist.barrier()
    return ok.report()


@pytest.mark.multiproc
def test_skipped_backward_leaves_no_gradient_receive_posted() -> None:
    from tests.helpers.dist import run_ranks

    assert run_ranks(_skip_body, 2, timeout=60) == [(3, [])] * 2


def _mismatch_body() -> list[str]:
    """Runs on every rank: the step function decides about model.backward differently on
    the two ranks, both ways round; rank 0 (its backward follows the gradient messages)
    names the mismatch, rank 1 finishes its step."""
    import torch.distributed as dist

    model = _two_rank_model(2, "interleaved")

    @smp.step
    def train(model: Any, x: torch.Tensor, skip_rank: int) -> Any:
        out = model(x)
        if smp.rank() != skip_rank or x[0, 0] > 0:  # skips microbatch 1 on skip_rank
            model.backward(out.sum())
        return out

    x = torch.ones(4, 4)
    x[2:, 0] = -1.0
    seen = []
    for skip_rank in (0, 1, -1):  # -1: alike again, the model still works
        try:
            train(model, x, skip_rank)
            seen.append("ok")
        except SMPRuntimeError as exc:
            seen.append(str(exc))
        dist.barrier()
    return seen


@pytest.mark.multiproc
def test_ranks_deciding_backward_differently_is_a_clear_error() -> None:
    from tests.helpers.dist import run_ranks

    rank0, rank1 = run_ranks(_mismatch_body, 2, timeout=60)
    assert rank1 == ["ok", "ok", "ok"] and rank0[2] == "ok"
    assert all("must call model.backward for the same microbatches" in m
               and "stage 0 microbatch 1" in m for m in rank0[:2]), rank0
    assert "did not call it" in rank0[0] and "did call it" in rank0[1]


def _slow_first_body(pipeline: str) -> list[float]:
    """Runs on every rank: microbatch 0's step function is slow to call the model, so
    the function of microbatch 1 (started a forward ahead on rank 0) is ready first; the
    step must neither hang nor change the numbers."""
    import time

    import torch.distributed as dist

    model = _two_rank_model(4, pipeline)

    @smp.step
    def train(model: Any, x: torch.Tensor, slow: bool) -> Any:
        if slow and x[0, 0] == 0:
            time.sleep(0.2)
        out = model(x)
        if torch.is_grad_enabled():
            model.backward(out.sum())
        return out.sum()

    x = torch.arange(32.0).view(8, 4) / 32
    losses = []
    for slow in (False, True):
        model.zero_grad()
        losses.append(train(model, x, slow).reduce_sum().item())
        with torch.no_grad():
            losses.append(train(model, x, slow).reduce_sum().item())
    dist.barrier()
    return losses


@pytest.mark.multiproc
@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_a_slow_first_microbatch_neither_hangs_nor_changes_results(pipeline: str) -> None:
    from tests.helpers.dist import run_ranks

    a, b = run_ranks(_slow_first_body, 2, pipeline, timeout=60)
    assert a == b and a[0] == a[2] and a[1] == a[3], a


class _DeadEnd(nn.Module):
    """Stage 1 (``d``) computes a value nothing uses: it sends nothing on."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.d, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.d(h)
        return self.b(h)


def test_a_stage_that_sends_nothing_gets_the_outputs_on_their_own_channel() -> None:
    gm = torch.fx.symbolic_trace(_DeadEnd())
    for n in gm.graph.nodes:
        if n.op == "call_module":
            meta.STAGE.set(n, "adb".index(n.target))
    prog = split_stages(gm)
    assert not prog.stages[1].sends
    s = sched.generate("interleaved", 3, 1)
    assert [str(o) for o in lower(s, prog, [1], True).ops] == [
        "1RECV_ACT0@0", "1F0", "1RECV_OUT0@2", "1WAIT_B0", "1B0", "1SEND_GRAD0@0"]
    assert [str(o) for o in lower(s, prog, [2], True).ops] == [
        "2RECV_ACT0@0", "2F0", "2SEND_OUT0@1", "2WAIT_B0", "2B0", "2SEND_GRAD0@0"]
    assert [str(o) for o in lower(s, prog, [0], True).ops] == [
        "0F0", "0SEND_ACT0@1", "0SEND_ACT0@2", "0RECV_GRAD0@1", "0RECV_GRAD0@2", "0B0"]


def _dead_end_body() -> list[str]:
    """Runs on 3 ranks: the stage that sends nothing on still returns the outputs to its
    step function; loss and gradients equal the plain model's."""
    import copy

    import torch.distributed as dist

    dist.init_process_group("gloo")
    init(3, 2, "interleaved", auto_partition=False, default_partition=0)
    torch.manual_seed(0)
    net = _DeadEnd()
    ref = copy.deepcopy(net)
    for i, name in enumerate("adb"):
        smp.set_partition(getattr(net, name), i)
    # gradients summed over microbatches, as the reference's over the whole batch
    model = smp.DistributedModel(net, average_grads_across_microbatches=False)

    @smp.step
    def train(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).pow(2).sum()
        model.backward(loss)
        return loss

    x = torch.arange(16.0).view(4, 4) / 16
    loss = train(model, x).reduce_sum()
    ref_loss = ref(x).pow(2).sum()
    ref_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    got = {n: p.grad for n, p in model.named_parameters() if n in dict(
        model.local_named_parameters())}
    bad = mismatched({"loss": loss, **got}, {"loss": ref_loss, **want}, atol=1e-5)
    dist.barrier()
    return bad


@pytest.mark.multiproc
def test_a_stage_that_sends_nothing_runs_across_processes() -> None:
    from tests.helpers.dist import run_ranks

    for bad in run_ranks(_dead_end_body, 3, timeout=90):
        assert bad == [], bad
