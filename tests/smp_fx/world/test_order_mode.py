"""``SMP_FX_CHECK_ORDER=1`` on real gloo ranks: a clean step passes, two all-reduces of one
shape issued in swapped order on two ranks (gloo runs them) are named at the step's end;
torch's methods are wrapped only between ``install`` and the reset; ``DistributedModel.join()``
pauses the comparison."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

import smp_fx as smp
from smp_fx.world import order_mode, state
from tests.helpers.dist import run_ranks

ALLREDUCE = dist.ProcessGroup.allreduce  # torch's own, as imported before any smp.init


def _swapped_step() -> dict[str, object]:
    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    wrapped = dist.ProcessGroup.allreduce is not ALLREDUCE
    model = smp.DistributedModel(torch.nn.Linear(4, 2))
    group = smp.get_dp_process_group()

    @smp.step
    def step(model: smp.DistributedModel, x: torch.Tensor, swap: bool) -> torch.Tensor:
        a, b = torch.ones(3), torch.ones(3)
        funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", group))  # DTensor's path
        if swap and smp.rank() == 1:
            dist.all_reduce(b, group=group)
            dist.all_reduce(a, group=group)
        else:
            dist.all_reduce(a, group=group)
            dist.all_reduce(b, group=group)
        loss = model(x).sum()
        model.backward(loss)
        return loss

    step(model, torch.ones(2, 4), False)
    try:
        step(model, torch.ones(2, 4), True)
        error = ""
    except smp.SMPOrderError as exc:
        error = str(exc)
    state._reset()
    return {"wrapped": wrapped, "error": error,
            "restored": dist.ProcessGroup.allreduce is ALLREDUCE}


@pytest.mark.multiproc
@pytest.mark.usefixtures("check_order")  # the switch as the grid gets it (run_ranks forwards it)
def test_swapped_all_reduces_are_named_on_every_rank() -> None:
    out = run_ranks(_swapped_step, 2, timeout=120)
    for rank in out:
        assert rank["wrapped"] and rank["restored"]
        error = str(rank["error"])
        assert "ranks 0 and 1 issued different collectives" in error, error
        assert "the world/dp/rdp/edp group (group 0, ranks [0, 1])" in error, error
        assert "step 2" in error, error
        # position 1: the funcol all-reduce agrees, the first of the swapped pair does not
        assert "position 1 " in error and "all_reduce([3] float32) at world/test_order_mode.py:" \
            in error, error
    assert out[0]["error"] == out[1]["error"]


def test_only_install_wraps_and_the_reset_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch's values; one process has nothing to compare, so ``smp.init`` does not
    install even with it on; ``install`` wraps, the reset puts torch's methods back."""
    for value, on in (("0", False), ("", False), ("1", True)):
        monkeypatch.setenv(order_mode.ENV, value)
        assert order_mode.enabled() is on
    smp.init({"pipeline_parallel_degree": 1})
    assert dist.ProcessGroup.allreduce is ALLREDUCE and order_mode._ACTIVE is None
    order_mode.install(timedelta(seconds=30), state.get().groups, state.get().object_groups)
    assert dist.ProcessGroup.allreduce is not ALLREDUCE
    state._reset()
    assert dist.ProcessGroup.allreduce is ALLREDUCE and order_mode._ACTIVE is None
    smp.init({"pipeline_parallel_degree": 1})  # torch's methods still work as before
    t = torch.ones(2)
    dist.all_reduce(t)
    assert funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD)).tolist() == [1, 1]


def test_paused_compares_nothing_and_drops_its_calls(caplog: pytest.LogCaptureFixture) -> None:
    """Inside ``DistributedModel.join()`` ranks step unevenly: no gather there (it would
    wait for a rank that shadows instead of stepping); the calls are dropped, logged."""
    smp.init({"pipeline_parallel_degree": 1})
    order_mode.install(timedelta(seconds=30), state.get().groups, state.get().object_groups)
    recorder = order_mode._ACTIVE
    assert recorder is not None
    with order_mode.paused("a join"):
        with order_mode.checked_step():
            dist.all_reduce(torch.ones(2))
        assert recorder.step == 0
    assert "1 calls inside a join were not compared" in caplog.text
    with order_mode.checked_step():
        dist.all_reduce(torch.ones(2))
    assert recorder.step == 1 and recorder.take() == {}
    with pytest.raises(ZeroDivisionError), order_mode.checked_step():
        dist.all_reduce(torch.ones(2))
        raise ZeroDivisionError  # a step that failed: gathered, not compared, re-raised
    assert recorder.step == 2 and "step 2 failed on ranks [0]" in caplog.text
