"""The first step's plan: where it traces and what it refuses to measure."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.runtime import planning
from smp_fx.world import state
from tests.helpers.numerics import init


def test_timing_nodes_on_the_host_for_a_device_run_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """trace_execution_times with the weights on the host and the rank's device elsewhere
    (a GPU) would plan a GPU run on host times: a clear error, not a silent plan."""
    init(2, 2, "simple")
    on_gpu = dataclasses.replace(state.get(), device=torch.device("meta"))
    monkeypatch.setattr(planning.state, "get", lambda: on_gpu)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(smp.SMPNotImplementedError, match="trace_execution_times"):
        planning.plan_stages(model, (torch.zeros(2, 4),), {}, times=True)


def test_the_first_microbatch_is_traced_where_the_weights_are() -> None:
    model = nn.Linear(2, 2)
    x = torch.zeros(1, 2)
    assert planning.on_module_device(model, (x,))[0] is x  # already there: not copied
    meta = nn.Linear(2, 2, device="meta")
    assert planning.weights_device(meta) is None
    assert planning.on_module_device(meta, (x,))[0] is x  # meta weights follow the inputs
