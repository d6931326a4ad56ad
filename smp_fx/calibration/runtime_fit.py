"""The figures calibration fits through the smp-fx runtime itself.

Why apart from the device figures: these train small models with ``smp.step`` (one stage,
or a pipeline across the calibrating processes; ``runs``) and fit the spec's runtime
figures so that the plans' predicted steps equal the measured ones:

- ``fit_actions``: the runtime's cost per action and per step (``tiny`` at 1 and 8
  microbatches, one stage; ``fit_runtime`` solves it);
- ``fit_in_step``: how much slower the model's ops and its Adam step run inside a real
  training step than the per-microbatch fits say (the reference transformer, one stage);
- ``fit_pipeline``: the cost per message and ``pipelined_scale`` at pipeline degree N
  (``solve_pipeline`` solves it).

Each returns figures; ``smp_fx.calibration.spec`` writes them into the spec with their
sources. ``steps`` is the number of timed steps per run.
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
    """The runtime's cost per action and per step, fitted on one stage.

    Why one stage: there nothing but the runtime's own work separates the measured step
    from the priced compute, so the two figures are not polluted by waiting or message
    costs (fitted at pipeline degree 2, the cost per action came out ten times too high
    and over-predicted every one-stage step by 65 %). Every process runs its own
    one-stage model (dp = the process count, no ddp); rank 0's steps are timed while the
    others wait (``spec.from_rank0``)."""
    with runs.replicas_apart():
        timings, plans = _tiny_runs(spec, device, steps, 1)
    return fit_runtime(spec, plans, timings)


def fit_runtime(spec: DeviceSpec, plans: dict[int, PartitionPlan], timings: dict[int, float]
                ) -> tuple[float, float]:
    """(seconds per action, seconds per step) that make the plans' predicted steps (the
    simulated pipeline plus the fixed step cost; no optimizer step was timed) equal the
    measured ones. The prediction is linear in the step cost and, along the critical path,
    in the action cost, so two microbatch counts give a 2 x 2 system. Neither figure goes
    below 0 (a negative one is noise: the per-step cost is then fitted at the first
    microbatch count alone)."""
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
    """(node scale, optimizer scale): how much slower the reference transformer's ops and
    its Adam step run in a training step on one stage (``smp.step`` over
    ``IN_STEP_MICROBATCHES`` microbatches, then ``optimizer.step()``) than ``spec``
    predicts, each clamped to ``IN_STEP_LIMITS``; rank 0's steps are timed (the other
    ranks return (1.0, 1.0)).

    Why: the in-place factors are fitted on single forward and backward passes, Adam's
    figures on Adam alone, and a training step adds what neither sees: gradients
    accumulated over the microbatches, one microbatch's data evicted by the next, Adam
    reading gradients just written. On the 2-core development VM the reference's step ran
    1.09 x its prediction while its single forward and backward ran 1.02-1.05 x theirs,
    and the example models' Adam steps 0.97-1.32 x theirs."""
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
    """(seconds per message, ``pipelined_scale``) at pipeline degree ``world``; None on
    ranks other than 0.

    The runtime's cost per message (posting and completing a send or receive) and how
    much slower each rank's ops run when the pipeline's ranks share the host: ``tiny``
    (almost all messages and actions) at two microbatch counts and the reference
    transformer (almost all compute) are trained, and both figures are fitted together
    (``solve_pipeline``). Why the second: on 2 CPU cores the GPT example's ops ran 12-23 %
    slower at pipeline degree 2 than alone (torch.profiler), which neither the
    one-process fits nor a tiny model show; fitted one after the other, the per-message
    cost absorbed it and the scale moved between runs."""
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
