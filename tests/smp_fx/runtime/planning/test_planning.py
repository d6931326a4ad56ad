"""The first step's plan: where it traces and what it refuses to measure."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.runtime.planning import planning
from smp_fx.world import state
from tests.helpers.numerics import init


def test_timing_nodes_on_the_host_for_a_device_run_is_refused() -> None:
    """trace_execution_times with the weights on the host and the rank's device elsewhere
    (a GPU) would plan a GPU run on host times: a clear error, not a silent plan."""
    init(2, 2, "simple")
    on_gpu = dataclasses.replace(state.get(), device=torch.device("meta"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(smp.SMPNotImplementedError, match="trace_execution_times"):
        planning.plan_stages(model, (torch.zeros(2, 4),), {}, True, False, (), on_gpu)


def test_the_first_microbatch_is_traced_where_the_weights_are() -> None:
    model = nn.Linear(2, 2)
    x = torch.zeros(1, 2)
    assert planning.on_module_device(model, (x,))[0] is x  # already there: not copied
    meta = nn.Linear(2, 2, device="meta")
    assert planning.weights_device(meta) is None
    assert planning.on_module_device(meta, (x,))[0] is x  # meta weights follow the inputs


@smp.step
def _train(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    model.backward(out.sum())
    return out


@pytest.mark.parametrize("skip", [False, True])
def test_skip_tracing_never_runs_the_model(one_thread: None, skip: bool) -> None:
    """'skip_tracing': true plans from fake tensors only: a model whose shapes need one real
    forward (a data-dependent leaf) plans without it, and fails with it, naming the leaf;
    measuring the tracing step is refused at wrapping."""
    from tests.helpers.models import WithUntraceable

    init(2, 1, "simple", skip_tracing=skip)
    torch.manual_seed(0)
    model = smp.DistributedModel(WithUntraceable())
    x = torch.randn(3, 8)
    if not skip:
        assert _train(model, x).outputs[0].shape == (3, 4)
    else:
        with pytest.raises(smp.SMPTracingError, match="(?s)data-dependent.*drop 'skip_tracing'"):
            _train(model, x)
        state._reset()
        init(2, 1, "simple", skip_tracing=True)
        with pytest.raises(smp.SMPConfigError, match="skip_tracing"):
            smp.DistributedModel(WithUntraceable(), trace_execution_times=True)
