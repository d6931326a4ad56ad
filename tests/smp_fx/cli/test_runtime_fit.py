"""The fits ``smp-fx calibrate`` makes through the runtime (``smp_fx.cli.runtime_fit``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from cost_model.calibrate import LOOPBACK
from cost_model.devices import A100
from passes.partition_config import PartitionConfig
from passes.pipeline import compile_model
from smp_fx.cli import runtime_fit


def test_runtime_fit_recovers_the_costs_it_was_given() -> None:
    """Step times made by the plans' own model with known per-action and per-step costs
    are fitted back to those costs (pipeline degree 2, so the critical path matters)."""
    spec = dataclasses.replace(A100, message_overhead_s=20e-6)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    plans = {m: compile_model(model, (torch.randn(2, 8),), None,
                              PartitionConfig(num_stages=2, microbatches=m), device=spec).plan
             for m in runtime_fit.FIT_MICROBATCHES}
    truth = dataclasses.replace(spec, microbatch_overhead_s=150e-6, step_overhead_s=400e-6,
                                optimizer_tensor_s=0.0, optimizer_byte_s=0.0)
    timings = {}
    for m, plan in plans.items():
        priced = dataclasses.replace(plan, device=truth.to_json())
        timings[m] = priced.training_step_s(priced.simulate())
    per_action, per_step = runtime_fit.fit_runtime(spec, plans, timings)
    assert per_action == pytest.approx(150e-6, rel=1e-6)
    assert per_step == pytest.approx(400e-6, rel=1e-6)


def test_in_step_fit_recovers_the_factors_it_was_given(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The reference transformer really trained on one stage; its step and Adam times
    replaced by the prediction x 1.3 and Adam's x 0.8 are fitted back to (1.3, 0.8), and
    absurd times are clamped to the limits."""
    real = runtime_fit._time_runtime
    factors = [(1.3, 0.8)]

    def scaled(spec: Any, *args: Any, **kwargs: Any) -> runtime_fit.Timed:
        timed = real(spec, *args, **kwargs)
        nodes, adam = factors[0]
        base = runtime_fit._predicted_step(timed.plan, spec, 1.0)
        work = runtime_fit._predicted_step(timed.plan, spec, 2.0) - base
        optimizer = sum(st.optimizer_time_s for st in timed.plan.stages)
        return runtime_fit.Timed(base + (nodes - 1.0) * work, adam * optimizer, timed.plan)

    monkeypatch.setattr(runtime_fit, "_time_runtime", scaled)
    args = argparse.Namespace(quick=True, steps=3)
    spec = dataclasses.replace(LOOPBACK, optimizer_tensor_s=20e-6, optimizer_byte_s=1e-9)
    cpu = torch.device("cpu")
    assert runtime_fit.fit_in_step(spec, cpu, args) == (pytest.approx(1.3),
                                                         pytest.approx(0.8))
    factors[0] = (50.0, 0.0)
    assert runtime_fit.fit_in_step(spec, cpu, args) == (runtime_fit.IN_STEP_LIMITS[1],
                                                         runtime_fit.IN_STEP_LIMITS[0])
