"""The fits ``smp-fx calibrate`` makes through the smp-fx runtime itself.

Why apart from the device figures: these train small models with ``smp.step`` (one stage,
or a pipeline across the calibrating processes) and fit the spec's runtime figures so that
the plans' predicted steps equal the measured ones:

- ``fit_actions``: the runtime's cost per action and per step (a tiny model at 1 and 8
  microbatches, one stage);
- ``fit_in_step``: how much slower the model's ops and its Adam step run inside a real
  training step than the per-microbatch fits say (the reference transformer, one stage);
- ``fit_pipeline``: the cost per message and ``pipelined_scale`` at pipeline degree N.

Each returns figures; ``smp_fx.cli.calibrate`` writes them into the spec with their sources.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from cost_model import microbench
from cost_model.device import DeviceSpec
from smp_fx.cli.reference_model import BATCH, SEQ, VOCAB, Reference, least_squares

FIT_MICROBATCHES = (1, 8)
FIT_BATCH = 16  # samples per step: two per microbatch at 8


def _runs(spec: DeviceSpec, device: torch.device, args: argparse.Namespace, stages: int
          ) -> tuple[dict[int, float], dict[int, Any]]:
    """(median step seconds, plan) at each of FIT_MICROBATCHES on ``stages`` stages."""
    import smp_fx as smp
    from smp_fx.world import state

    timings: dict[int, float] = {}
    plans: dict[int, Any] = {}
    for m in FIT_MICROBATCHES:
        smp.init({"pipeline_parallel_degree": stages, "microbatches": m,
                  "pipeline": "interleaved"})
        try:
            timings[m], _, plans[m] = _time_runtime(spec, device, m, args, alone=stages == 1)
        finally:
            state._reset()
    return timings, plans


def fit_actions(spec: DeviceSpec, device: torch.device, args: argparse.Namespace
                ) -> tuple[float, float]:
    """The runtime's cost per action and per step, fitted on one stage.

    Why one stage: there nothing but the runtime's own work separates the measured step
    from the priced compute, so the two figures are not polluted by waiting or message
    costs (fitted at pipeline degree 2, the cost per action came out ten times too high
    and over-predicted every one-stage step by 65 %). Every process runs its own
    one-stage model (dp = the process count, no ddp); rank 0's steps are timed while the
    others wait (``_from_rank0``)."""
    with _replicas_apart():
        timings, plans = _runs(spec, device, args, 1)
    return fit_runtime(spec, plans, timings)


IN_STEP_MICROBATCHES = 4
IN_STEP_LIMITS = (0.5, 2.0)


def fit_in_step(spec: DeviceSpec, device: torch.device, args: argparse.Namespace
                ) -> tuple[float, float]:
    """(node scale, optimizer scale): how much slower the reference transformer's ops and
    its Adam step run in a training step on one stage (``smp.step`` over
    ``IN_STEP_MICROBATCHES`` microbatches, then ``optimizer.step()``) than ``spec``
    predicts, each clamped to ``IN_STEP_LIMITS``; rank 0's steps are timed.

    Why: the in-place factors are fitted on single forward and backward passes, Adam's
    figures on Adam alone, and a training step adds what neither sees: gradients
    accumulated over the microbatches, one microbatch's data evicted by the next, Adam
    reading gradients just written. On the 2-core development VM the reference's step ran
    1.09 x its prediction while its single forward and backward ran 1.02-1.05 x theirs,
    and the example models' Adam steps 0.97-1.32 x theirs."""
    import smp_fx as smp
    from smp_fx.world import state

    with _replicas_apart():
        smp.init({"pipeline_parallel_degree": 1, "microbatches": IN_STEP_MICROBATCHES,
                  "pipeline": "interleaved"})
        try:
            timed = _time_runtime(spec, device, IN_STEP_MICROBATCHES, args, alone=True,
                                  reference=True, optimizer=True)
        finally:
            state._reset()
    if int(os.environ.get("RANK", "0")) != 0:
        return 1.0, 1.0
    base = _predicted_step(timed.plan, spec, 1.0)
    nodes = _predicted_step(timed.plan, spec, 2.0) - base
    adam = sum(st.optimizer_time_s for st in timed.plan.stages)
    lo, hi = IN_STEP_LIMITS
    node_scale = 1.0 + (timed.step_s - base) / nodes if nodes > 0 else 1.0
    optimizer_scale = timed.optimizer_s / adam if adam > 0 else 1.0
    return min(max(node_scale, lo), hi), min(max(optimizer_scale, lo), hi)


@contextlib.contextmanager
def _replicas_apart() -> Iterator[None]:
    """Every process trains its own one-stage replica on purpose (dp = the process count,
    no ddp): the runtime's warnings about that are silenced."""
    ddp_log = logging.getLogger("smp_fx.parallel.ddp")
    level = ddp_log.level
    ddp_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*'ddp' is false.*")
            yield
    finally:
        ddp_log.setLevel(level)


def _predicted_step(plan: Any, spec: DeviceSpec, scale: float,
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


PIPELINED_MICROBATCHES = 4


def fit_pipeline(spec: DeviceSpec, device: torch.device, args: argparse.Namespace,
                 world: int) -> tuple[float, float] | None:
    """(seconds per message, ``pipelined_scale``) at pipeline degree ``world``; None on
    ranks other than 0.

    The runtime's cost per message (posting and completing a send or receive) and how
    much slower each rank's ops run when the pipeline's ranks share the host: a tiny model
    (almost all messages and actions) at two microbatch counts and the reference
    transformer (almost all compute) are trained, and both figures are fitted together,
    least squares of the relative errors, the prediction being linear in each. Why the
    second: on 2 CPU cores the GPT example's ops ran 12-23 % slower at pipeline degree 2
    than alone (torch.profiler), which neither the one-process fits nor a tiny model
    show; fitted one after the other, the per-message cost absorbed it and the scale
    moved between runs. The per-message cost stays at least what posting one was
    measured to cost (``with_link``)."""
    import smp_fx as smp
    from smp_fx.world import state

    tiny_times, tiny_plans = _runs(spec, device, args, world)
    smp.init({"pipeline_parallel_degree": world, "microbatches": PIPELINED_MICROBATCHES,
              "pipeline": "interleaved"})
    try:
        ref_time, _, ref_plan = _time_runtime(spec, device, PIPELINED_MICROBATCHES, args,
                                              reference=True)
    finally:
        state._reset()
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    runs = [(tiny_times[m], tiny_plans[m]) for m in tiny_times] + [(ref_time, ref_plan)]
    probe = 1e-3
    rows = []  # per run, relative: (d/d per_message, d/d scale, measured - base)
    for measured, plan in runs:
        base = _predicted_step(plan, spec, 1.0, 0.0)
        rows.append(((_predicted_step(plan, spec, 1.0, probe) - base) / probe / measured,
                     (_predicted_step(plan, spec, 2.0, 0.0) - base) / measured,
                     (measured - base) / measured))
    floor = spec.message_overhead_s
    solved = least_squares(rows)
    msg, extra = solved if solved is not None else (floor, 0.0)
    if msg < floor:  # hold it at the floor, fit the scale alone
        b2 = sum(b * b for _, b, _ in rows)
        extra = sum(b * (r - a * floor) for a, b, r in rows) / b2 if b2 > 0 else 0.0
        msg = floor
    lo, hi = PIPELINED_LIMITS
    return msg, min(max(1.0 + extra, lo), hi)


PIPELINED_LIMITS = (0.5, 4.0)


def _tiny(stages: int) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU())
                           for _ in range(2 * stages)], nn.Linear(16, 4))


class Timed(NamedTuple):
    """Medians of the timed steps (seconds): the ``smp.step`` function, and the Adam step
    after it (NaN when none ran); and the plan they ran."""

    step_s: float
    optimizer_s: float
    plan: Any


def _time_runtime(spec: DeviceSpec, device: torch.device, microbatches: int,
                  args: argparse.Namespace, alone: bool = False, reference: bool = False,
                  optimizer: bool = False) -> Timed:
    """``smp.step`` timed on a tiny model, or with ``reference`` the reference transformer,
    on every rank, and with ``optimizer`` an Adam step after each; ``alone``: only rank 0
    runs the timed steps (the others' times are NaN)."""
    import smp_fx as smp

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec.to_json()), encoding="utf-8")
        old = os.environ.get("SMP_FX_DEVICE_SPEC")
        os.environ["SMP_FX_DEVICE_SPEC"] = str(path)  # plan for what was just measured
        try:
            module = (Reference() if reference else _tiny(smp.pp_size())).to(device)
            adam = smp.DistributedOptimizer(torch.optim.Adam(module.parameters(), lr=1e-4))
            model = smp.DistributedModel(module)
            if reference:
                x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
                y = x
            else:
                x = torch.randn(FIT_BATCH, 16, device=device)
                y = torch.randint(0, 4, (FIT_BATCH,), device=device)

            @smp.step
            def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
                out = model(x)  # the reference's loss: the mean, nearly free and unpriced
                loss = out.mean() if reference else F.cross_entropy(out, y)
                model.backward(loss)
                return loss

            train_step(model, x, y)
        finally:
            if old is None:
                os.environ.pop("SMP_FX_DEVICE_SPEC", None)
            else:
                os.environ["SMP_FX_DEVICE_SPEC"] = old
    steps = 8 if args.quick else args.steps
    # one stage: the process's CPU time (steady under other load); several: the wall time,
    # which holds the waits for the other stage that the simulator models
    now = microbench.clock(device) if smp.pp_size() == 1 else time.perf_counter
    if alone and smp.rank() != 0:
        smp.barrier()
        return Timed(float("nan"), float("nan"), model.plan)
    times: list[float] = []
    adam_times: list[float] = []
    for i in range(steps + 3):
        if not alone:
            smp.barrier()
        adam.zero_grad()
        t0 = now()
        train_step(model, x, y)
        _finish(device)
        t1 = now()
        if optimizer:
            adam.step()
            _finish(device)
        if i >= 3:
            times.append(t1 - t0)
            adam_times.append(now() - t1)
    smp.barrier()
    return Timed(statistics.median(times),
                 statistics.median(adam_times) if optimizer else float("nan"), model.plan)


def _finish(device: torch.device) -> None:
    """Wait for the device's queued work (a step's kernels done, not only queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit_runtime(spec: DeviceSpec, plans: dict[int, Any], timings: dict[int, float]
                ) -> tuple[float, float]:
    """(seconds per action, seconds per step) that make the plans' predicted steps (the
    simulated pipeline plus the fixed step cost; no optimizer step was timed) equal the
    measured ones. The prediction is linear in the step cost and, along the critical path,
    in the action cost, so two microbatch counts give a 2 x 2 system."""
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
