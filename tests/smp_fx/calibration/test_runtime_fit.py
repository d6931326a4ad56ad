"""The figures calibration fits through the runtime (``smp_fx.calibration.runtime_fit``):
each fitted back from times made with known figures, and clamped where the times are
absurd."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from cost_model.calibrate import LOOPBACK
from cost_model.devices import A100
from passes.partition_config import PartitionConfig
from passes.pipeline import compile_model
from smp_fx.calibration import runs, runtime_fit

CPU = torch.device("cpu")


def test_runtime_fit_recovers_the_costs_it_was_given() -> None:
    """Step times made by the plans' own model with known per-action and per-step costs
    are fitted back to those costs (pipeline degree 2, so the critical path matters); a
    step that gets cheaper with more microbatches holds the per-action cost at 0."""
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
    m1, m2 = runtime_fit.FIT_MICROBATCHES
    base = runtime_fit.fit_runtime(spec, plans, {m1: timings[m1], m2: timings[m1]})
    assert base[0] == 0.0 and base[1] > 0


def test_in_step_fit_recovers_the_factors_it_was_given(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The reference transformer really trained on one stage; its step and Adam times
    replaced by the prediction x 1.3 and Adam's x 0.8 are fitted back to (1.3, 0.8), and
    absurd times are clamped to the limits."""
    real = runs.time_steps
    factors = [(1.3, 0.8)]

    def scaled(spec: Any, *args: Any, **kwargs: Any) -> runs.Timed:
        timed = real(spec, *args, **kwargs)
        nodes, adam = factors[0]
        base = runtime_fit.predicted_step(timed.plan, spec, 1.0)
        work = runtime_fit.predicted_step(timed.plan, spec, 2.0) - base
        optimizer = sum(st.optimizer_time_s for st in timed.plan.stages)
        return runs.Timed(base + (nodes - 1.0) * work, adam * optimizer, timed.plan)

    monkeypatch.setattr(runs, "time_steps", scaled)
    spec = dataclasses.replace(LOOPBACK, optimizer_tensor_s=20e-6, optimizer_byte_s=1e-9)
    assert runtime_fit.fit_in_step(spec, CPU, steps=1) == (pytest.approx(1.3),
                                                          pytest.approx(0.8))
    factors[0] = (50.0, 0.0)
    assert runtime_fit.fit_in_step(spec, CPU, steps=1) == (runtime_fit.IN_STEP_LIMITS[1],
                                                          runtime_fit.IN_STEP_LIMITS[0])


def test_pipeline_fit_recovers_the_figures_it_was_given(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The tiny model and the reference really trained at pipeline degree 2 (in one
    process); their step times replaced by the prediction at 1.5e-4 s per message with
    the ops 1.3 x slower are fitted back to (1.5e-4, 1.3), strictly inside the limits."""
    real = runs.time_steps

    def scaled(spec: Any, *args: Any, **kwargs: Any) -> runs.Timed:
        timed = real(spec, *args, **kwargs)
        made = runtime_fit.predicted_step(timed.plan, spec, 1.3, 1.5e-4)
        return runs.Timed(made, timed.optimizer_s, timed.plan)

    monkeypatch.setattr(runs, "time_steps", scaled)
    spec = dataclasses.replace(LOOPBACK, message_overhead_s=2e-5)
    fitted = runtime_fit.fit_pipeline(spec, CPU, steps=1, world=2)
    assert fitted == (pytest.approx(1.5e-4, rel=1e-6), pytest.approx(1.3, rel=1e-6))
    lo, hi = runtime_fit.PIPELINED_LIMITS
    assert lo < fitted[1] < hi


def _rows(per_message: float, scale: float) -> list[tuple[float, float, float]]:
    return [(a, b, a * per_message + b * (scale - 1.0))
            for a, b in ((0.4, 0.1), (0.9, 0.2), (0.03, 0.9))]


def test_pipeline_solve_holds_the_floor_and_the_limits() -> None:
    """Known figures come back; a per-message cost below the floor is held there with the
    scale fitted alone; a scale beyond the limits is clamped to them."""
    assert runtime_fit.solve_pipeline(_rows(1.5e-4, 1.3), 1e-5) == (
        pytest.approx(1.5e-4), pytest.approx(1.3))
    msg, scale = runtime_fit.solve_pipeline(_rows(1e-6, 1.3), 1e-5)
    rows = _rows(1e-6, 1.3)
    alone = sum(b * (r - a * 1e-5) for a, b, r in rows) / sum(b * b for _, b, _ in rows)
    assert msg == 1e-5 and scale == pytest.approx(1.0 + alone) and 1.29 < scale < 1.3
    lo, hi = runtime_fit.PIPELINED_LIMITS
    assert runtime_fit.solve_pipeline(_rows(1.5e-4, 9.0), 1e-5)[1] == hi
    assert runtime_fit.solve_pipeline(_rows(1.5e-4, 0.1), 1e-5)[1] == lo
