"""The figures calibration fits through the smp-fx runtime itself, so that the plans'
predicted steps equal the measured ones: per action and step, in-step scales, per message
and ``pipelined_scale``. See docs/cli.md, 'smp-fx calibrate'.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from cost_model.device import DeviceSpec
from passes.plan import PartitionPlan
from smp_fx.calibration import runs
from smp_fx.calibration.solve import Row, clamp, least_squares

FIT_MICROBATCHES = (1, 8)
IN_STEP_MICROBATCHES = 4
IN_STEP_LIMITS = (0.5, 2.0)
PIPELINED_MICROBATCHES = 4
PIPELINED_LIMITS = (0.5, 4.0)


def _rank() -> int:
    """This process's rank under torchrun (0 alone)."""
    return int(os.environ.get("RANK", "0"))


def _tiny_runs(spec: DeviceSpec, device: torch.device, steps: int, stages: int
               ) -> tuple[dict[int, float], dict[int, PartitionPlan]]:
    """(median step seconds, plan) of ``tiny`` at each of FIT_MICROBATCHES on ``stages``
    stages."""
    timings: dict[int, float] = {}
    plans: dict[int, PartitionPlan] = {}
    for m in FIT_MICROBATCHES:
        with runs.initialized(stages, m):
            timings[m], _, plans[m] = runs.time_steps(spec, device, steps, alone=stages == 1)
    return timings, plans


def fit_actions(spec: DeviceSpec, device: torch.device, steps: int) -> tuple[float, float]:
    """The runtime's cost per action and per step, fitted on one stage, where nothing but the
    runtime's work separates measurement from priced compute (at pp 2 the action cost came
    out ten times too high); rank 0 is timed."""
    with runs.replicas_apart():
        timings, plans = _tiny_runs(spec, device, steps, 1)
    return fit_runtime(spec, plans, timings)


def fit_runtime(spec: DeviceSpec, plans: dict[int, PartitionPlan], timings: dict[int, float]
                ) -> tuple[float, float]:
    """(seconds per action, seconds per step) solving the 2 x 2 system two microbatch counts
    give; neither goes below 0 (noise)."""
    def predicted(m: int, per_action: float) -> float:
        s = dataclasses.replace(spec, microbatch_overhead_s=per_action, step_overhead_s=0.0,
                                optimizer_tensor_s=0.0, optimizer_byte_s=0.0)
        plan = dataclasses.replace(plans[m], device=s.to_json())
        return float(plan.training_step_s(plan.simulate()))

    probe = 1e-3
    (m1, m2) = FIT_MICROBATCHES
    base = {m: predicted(m, 0.0) for m in (m1, m2)}
    slope = {m: (predicted(m, probe) - base[m]) / probe for m in (m1, m2)}
    gap = {m: timings[m] - base[m] for m in (m1, m2)}
    per_action = (gap[m2] - gap[m1]) / max(slope[m2] - slope[m1], 1e-9)
    per_action = max(per_action, 0.0)
    per_step = max(gap[m1] - slope[m1] * per_action, 0.0)
    return per_action, per_step


def fit_in_step(spec: DeviceSpec, device: torch.device, steps: int) -> tuple[float, float]:
    """(node scale, optimizer scale): how much slower the reference's ops and Adam run in a
    real training step than predicted (accumulation, eviction), clamped; rank 0 timed."""
    with runs.replicas_apart(), runs.initialized(1, IN_STEP_MICROBATCHES):
        timed = runs.time_steps(spec, device, steps, alone=True, reference=True,
                                optimizer=True)
    if _rank() != 0:
        return 1.0, 1.0
    base = predicted_step(timed.plan, spec, 1.0)
    nodes = predicted_step(timed.plan, spec, 2.0) - base
    adam = sum(st.optimizer_time_s for st in timed.plan.stages)
    node_scale = 1.0 + (timed.step_s - base) / nodes if nodes > 0 else 1.0
    optimizer_scale = timed.optimizer_s / adam if adam > 0 else 1.0
    return clamp(node_scale, IN_STEP_LIMITS), clamp(optimizer_scale, IN_STEP_LIMITS)


def predicted_step(plan: PartitionPlan, spec: DeviceSpec, scale: float,
                   per_message: float | None = None) -> float:
    """``plan``'s predicted ``smp.step`` (no optimizer step) under ``spec``, every stage's
    forward and backward times ``scale``, and the cost per message ``per_message`` when
    given."""
    stages = tuple(dataclasses.replace(st, fwd_time_s=st.fwd_time_s * scale,
                                       bwd_time_s=st.bwd_time_s * scale)
                   for st in plan.stages)
    s = dataclasses.replace(spec, optimizer_tensor_s=0.0, optimizer_byte_s=0.0)
    if per_message is not None:
        s = dataclasses.replace(s, message_overhead_s=per_message)
    p = dataclasses.replace(plan, stages=stages, device=s.to_json())
    return float(p.training_step_s(p.simulate()))


def fit_pipeline(spec: DeviceSpec, device: torch.device, steps: int, world: int
                 ) -> tuple[float, float] | None:
    """(seconds per message, ``pipelined_scale``) at pipeline degree ``world``, fitted together
    (fitted one after the other, the message cost absorbed the slowdown); None off rank 0."""
    tiny_times, tiny_plans = _tiny_runs(spec, device, steps, world)
    with runs.initialized(world, PIPELINED_MICROBATCHES):
        ref_time, _, ref_plan = runs.time_steps(spec, device, steps, reference=True)
    if _rank() != 0:
        return None
    measured = [(tiny_times[m], tiny_plans[m]) for m in tiny_times] + [(ref_time, ref_plan)]
    return solve_pipeline(pipeline_rows(spec, measured), spec.message_overhead_s)


def pipeline_rows(spec: DeviceSpec, measured: list[tuple[float, PartitionPlan]]
                  ) -> list[Row]:
    """Per run (measured seconds, plan), relative to the measured step: (d/d per-message
    cost, d/d scale, measured - predicted at no message cost and scale 1); the prediction
    is linear in both (along the critical path), the first slope taken at 1 ms."""
    probe = 1e-3
    rows = []
    for seconds, plan in measured:
        base = predicted_step(plan, spec, 1.0, 0.0)
        rows.append(((predicted_step(plan, spec, 1.0, probe) - base) / probe / seconds,
                     (predicted_step(plan, spec, 2.0, 0.0) - base) / seconds,
                     (seconds - base) / seconds))
    return rows


def solve_pipeline(rows: list[Row], floor: float) -> tuple[float, float]:
    """(seconds per message, ``pipelined_scale``): least squares of the relative errors
    ``rows`` (``pipeline_rows``). The per-message cost stays at least ``floor``, what
    posting one was measured to cost (``cost_model.calibrate.with_link``; below it, it is
    held there and the scale fitted alone); the scale is clamped to ``PIPELINED_LIMITS``."""
    solved = least_squares(rows)
    msg, extra = solved if solved is not None else (floor, 0.0)
    if msg < floor:  # hold it at the floor, fit the scale alone
        b2 = sum(b * b for _, b, _ in rows)
        extra = sum(b * (r - a * floor) for a, b, r in rows) / b2 if b2 > 0 else 0.0
        msg = floor
    return msg, clamp(1.0 + extra, PIPELINED_LIMITS)
