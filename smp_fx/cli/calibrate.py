"""``smp-fx calibrate [-o FILE.json]``: measure this machine into a device spec file.

Why: ``smp-fx partition`` predicts what a plan will cost before one runs it, and those
predictions are only as good as the device spec they are priced with. The built-in specs
carry datasheet figures; this command measures the machine it runs on instead:

1. the device (``cost_model.calibrate``): matmul and element-wise throughput at several
   sizes, memory bandwidth, the fixed cost of each kind of op, an Adam step; then how
   much slower ops run inside a model than alone (``reference_model``);
2. with two or more processes (``--nproc 2``, or under ``smp-fx run -n 2``), the
   point-to-point link of the backend between ranks 0 and 1: latency, bandwidth and the
   time a rank spends per message;
3. the smp-fx runtime: a tiny model is trained with ``smp.step`` at 1 and 8 microbatches,
   first on one stage (each process its own), which fits the runtime's cost per action
   and per step; then, with two or more processes, at pipeline degree = the number of
   processes, together with the reference transformer at that degree, which fit the
   runtime's cost per message and how much slower ops run when the ranks share the host
   (``pipelined_scale``); each so that the plans' predicted step times equal the
   measured ones.

The spec is written as JSON (``DeviceSpec.to_json``); use it with
``smp-fx partition --device FILE.json`` or ``SMP_FX_DEVICE_SPEC=FILE.json`` for
``DistributedModel``. Measured with the torch thread count the process has: under
``smp-fx run -n 2`` (and ``--nproc 2``) that is one thread per process, as in training.

Example::

    smp-fx calibrate --nproc 2 -o cpu2.json
    smp-fx partition examples/models/gpt.py --partitions 2 --device cpu2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from cost_model import calibrate as measure
from cost_model import microbench
from cost_model.device import DeviceSpec
from cost_model.errors import SMPError
from smp_fx.cli.reference_model import (
    BATCH,
    SEQ,
    VOCAB,
    Reference,
    fit_conv_scale,
    fit_scales,
    least_squares,
)

FIT_MICROBATCHES = (1, 8)
FIT_BATCH = 16  # samples per step: two per microbatch at 8


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="smp-fx calibrate",
        description="Measure this machine (device, link, smp-fx runtime) into a device "
                    "spec JSON file for smp-fx partition --device and SMP_FX_DEVICE_SPEC.")
    p.add_argument("-o", "--output", metavar="FILE.json", help="write the spec here "
                   "(default: print it)")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes to measure with (2 or more: the link between two of "
                        "them, and the runtime at pipeline degree N)")
    p.add_argument("--name", help="spec name (default: calibrated-<device type>)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="device to measure (default: cuda if available)")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes and repeats (about a second; for tests)")
    p.add_argument("--steps", type=int, default=30,
                   help="timed smp.step steps per microbatch count in the runtime fit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``smp-fx calibrate``; returns the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if args.nproc < 1:
            raise SMPError.build("--nproc must be >= 1", args.nproc, "smp-fx calibrate",
                                 "use 1, or 2 to measure the link")
        if args.nproc > 1 and world == 1:
            return _relaunch(args, argv)
        spec = calibrate(args, world)
    except SMPError as exc:
        print(f"smp-fx calibrate: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    if spec is not None:
        _report(spec, args.output)
    return 0


def _relaunch(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """Run this command on ``--nproc`` processes through torchrun, as ``smp-fx run`` does."""
    given = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []  # the children learn their number from torchrun, not --nproc
    skip = False
    for arg in given:
        if skip or arg.startswith("--nproc="):
            skip = False
            continue
        skip = arg == "--nproc"
        if not skip:
            rest.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.nproc), "-m", "smp_fx.cli.calibrate", *rest]
    return subprocess.run(cmd, check=False).returncode


def calibrate(args: argparse.Namespace, world: int) -> DeviceSpec | None:
    """Measure on this process (one of ``world``); the spec on rank 0, None elsewhere."""
    from smp_fx.dist import launch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    name = args.name or f"calibrated-{device.type}"
    if world > 1:
        # one default group for the whole run: each smp.init below only adds its own
        # groups, which state._reset() removes again (re-creating the default group under
        # torchrun would rendezvous on keys the first one left in the store)
        dist.init_process_group(launch.choose_backend())
    spec = _from_rank0(lambda: measure.calibrate(name, device, quick=args.quick), world)
    spec = dataclasses.replace(spec, microbatch_overhead_s=0.0, step_overhead_s=0.0)
    if world > 1:
        spec = measure.with_link(spec, device, quick=args.quick)
    overhead, work = _from_rank0(lambda: fit_scales(spec, device, 5 if args.quick else 15),
                                 world)
    how_scaled = ("fitted by smp-fx calibrate: a two-block transformer's forward and backward "
                  "at three sizes (CPU time of one process) against its predicted fixed "
                  "costs and work, least squares")
    spec = dataclasses.replace(spec, compute_scale=work, overhead_scale=overhead).with_sources(
        compute_scale=how_scaled, overhead_scale=how_scaled)
    if any(k == "conv" for k, _, _ in spec.op_overheads):
        conv = _from_rank0(lambda: fit_conv_scale(spec, device, 5 if args.quick else 15),
                           world)
        spec = dataclasses.replace(spec, op_overheads=tuple(
            (k, f * conv, b * conv) if k == "conv" else (k, f, b)
            for k, f, b in spec.op_overheads)).with_sources(
            op_overheads=f"{spec.source('op_overheads')}; conv's then x {conv:.2f}, fitted "
                         "in place on a small ResNet-style stack (its forward and backward "
                         "against the prediction)")
    per_action, per_step = _from_rank0(lambda: _fit_actions(spec, device, args), world,
                                       everyone=lambda: _fit_actions(spec, device, args))
    spec = dataclasses.replace(spec, microbatch_overhead_s=per_action, step_overhead_s=per_step)
    how = (f"fitted by smp-fx calibrate: smp.step on one stage (one process's CPU time), "
           f"a tiny model at {' and '.join(map(str, FIT_MICROBATCHES))} microbatches")
    spec = spec.with_sources(microbatch_overhead_s=how, step_overhead_s=how)
    if world > 1:
        fitted = _fit_pipeline(spec, device, args, world)
        if fitted is not None:
            how = (f"fitted by smp-fx calibrate: smp.step at pipeline degree {world} (wall "
                   f"time), a tiny model at {' and '.join(map(str, FIT_MICROBATCHES))} "
                   f"microbatches and the reference transformer at {PIPELINED_MICROBATCHES}, "
                   "jointly (least squares of the relative errors)")
            spec = dataclasses.replace(spec, message_overhead_s=fitted[0],
                                       pipelined_scale=fitted[1]).with_sources(
                message_overhead_s=how, pipelined_scale=how)
    return spec if int(os.environ.get("RANK", "0")) == 0 else None


def _from_rank0(fn: Callable[[], Any], world: int, everyone: Callable[[], Any] | None = None
                ) -> Any:
    """``fn()`` measured by rank 0 alone (the others wait, or run ``everyone``, which
    must return what ``fn`` does), its result sent to every rank.

    Why alone: two processes measuring at once on a small machine slow each other down
    (shared caches and memory bandwidth; op costs came out up to twice as high), and the
    device and runtime figures must be one process's, as a one-stage run sees them. Every
    rank must plan with the same figures, so rank 0's are broadcast."""
    if world == 1:
        return fn()
    result = [fn() if dist.get_rank() == 0 else (everyone() if everyone else None)]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def _runs(spec: DeviceSpec, device: torch.device, args: argparse.Namespace, stages: int
          ) -> tuple[dict[int, float], dict[int, Any]]:
    """(median step seconds, plan) at each of FIT_MICROBATCHES on ``stages`` stages."""
    import smp_fx as smp
    from smp_fx.dist import state

    timings: dict[int, float] = {}
    plans: dict[int, Any] = {}
    for m in FIT_MICROBATCHES:
        smp.init({"pipeline_parallel_degree": stages, "microbatches": m,
                  "pipeline": "interleaved"})
        try:
            timings[m], plans[m] = _time_runtime(spec, device, m, args, alone=stages == 1)
        finally:
            state._reset()
    return timings, plans


def _fit_actions(spec: DeviceSpec, device: torch.device, args: argparse.Namespace
                 ) -> tuple[float, float]:
    """The runtime's cost per action and per step, fitted on one stage.

    Why one stage: there nothing but the runtime's own work separates the measured step
    from the priced compute, so the two figures are not polluted by waiting or message
    costs (fitted at pipeline degree 2, the cost per action came out ten times too high
    and over-predicted every one-stage step by 65 %). Every process runs its own
    one-stage model (dp = the process count, no ddp); rank 0's steps are timed while the
    others wait (``_from_rank0``)."""
    ddp_log = logging.getLogger("smp_fx.dist.ddp")
    level = ddp_log.level
    ddp_log.setLevel(logging.ERROR)  # the replicas train apart on purpose: no ddp warning
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*'ddp' is false.*")
            timings, plans = _runs(spec, device, args, 1)
    finally:
        ddp_log.setLevel(level)
    return fit_runtime(spec, plans, timings)


PIPELINED_MICROBATCHES = 4


def _fit_pipeline(spec: DeviceSpec, device: torch.device, args: argparse.Namespace,
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
    from smp_fx.dist import state

    tiny_times, tiny_plans = _runs(spec, device, args, world)
    smp.init({"pipeline_parallel_degree": world, "microbatches": PIPELINED_MICROBATCHES,
              "pipeline": "interleaved"})
    try:
        ref_time, ref_plan = _time_runtime(spec, device, PIPELINED_MICROBATCHES, args,
                                           reference=True)
    finally:
        state._reset()
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    runs = [(tiny_times[m], tiny_plans[m]) for m in tiny_times] + [(ref_time, ref_plan)]
    priced = dataclasses.replace(spec, optimizer_tensor_s=0.0, optimizer_byte_s=0.0)

    def predicted(plan: Any, per_message: float, scale: float) -> float:
        stages = tuple(dataclasses.replace(st, fwd_time_s=st.fwd_time_s * scale,
                                           bwd_time_s=st.bwd_time_s * scale)
                       for st in plan.stages)
        s = dataclasses.replace(priced, message_overhead_s=per_message)
        p = dataclasses.replace(plan, stages=stages, device=s.to_json())
        return float(p.training_step_s(p.simulate()))

    probe = 1e-3
    rows = []  # per run, relative: (d/d per_message, d/d scale, measured - base)
    for measured, plan in runs:
        base = predicted(plan, 0.0, 1.0)
        rows.append(((predicted(plan, probe, 1.0) - base) / probe / measured,
                     (predicted(plan, 0.0, 2.0) - base) / measured,
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


def _time_runtime(spec: DeviceSpec, device: torch.device, microbatches: int,
                  args: argparse.Namespace, alone: bool = False, reference: bool = False
                  ) -> tuple[float, Any]:
    """(median seconds of ``smp.step`` on a tiny model, or with ``reference`` the reference
    transformer, and its plan), on every rank; ``alone``: only rank 0 runs the timed
    steps (the others' time is NaN)."""
    import smp_fx as smp

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec.to_json()), encoding="utf-8")
        old = os.environ.get("SMP_FX_DEVICE_SPEC")
        os.environ["SMP_FX_DEVICE_SPEC"] = str(path)  # plan for what was just measured
        try:
            if reference:
                model = smp.DistributedModel(Reference().to(device))
                x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
                y = x
            else:
                model = smp.DistributedModel(_tiny(smp.pp_size()).to(device))
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
        return float("nan"), model.plan
    times = []
    for i in range(steps + 3):
        if not alone:
            smp.barrier()
        t0 = now()
        train_step(model, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            times.append(now() - t0)
    smp.barrier()
    return statistics.median(times), model.plan


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


def _report(spec: DeviceSpec, output: str | None) -> None:
    text = json.dumps(spec.to_json(), indent=1, sort_keys=True) + "\n"
    if output:
        Path(output).write_text(text, encoding="utf-8")
        width = max(len(k) for k, _ in measure.figures(spec))
        for key, value in measure.figures(spec):
            print(f"{key:<{width}}  {value}")
        print(f"wrote {output}")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    sys.exit(main())
