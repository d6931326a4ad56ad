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
3. the smp-fx runtime (``runtime_fit``): the reference transformer's training step with
   Adam on one stage, which scales the in-place factors and Adam's figures to a real
   step; a tiny model trained with ``smp.step`` at 1 and 8 microbatches, first on one
   stage (each process its own), which fits the runtime's cost per action and per step;
   then, with two or more processes, at pipeline degree = the number of processes,
   together with the reference transformer at that degree, which fit the runtime's cost
   per message and how much slower ops run when the ranks share the host
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
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cost_model import calibrate as measure
from cost_model.device import DeviceSpec
from cost_model.errors import SMPError
from smp_fx.cli.reference_model import fit_conv_scale, fit_scales
from smp_fx.cli.runtime_fit import (
    FIT_MICROBATCHES,
    IN_STEP_MICROBATCHES,
    PIPELINED_MICROBATCHES,
    fit_actions,
    fit_in_step,
    fit_pipeline,
)


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
    from smp_fx.world import launch

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
    in_step = functools.partial(fit_in_step, spec, device, args)  # every rank joins it
    spec = _in_step(spec, _from_rank0(in_step, world, everyone=in_step))
    actions = functools.partial(fit_actions, spec, device, args)
    per_action, per_step = _from_rank0(actions, world, everyone=actions)
    spec = dataclasses.replace(spec, microbatch_overhead_s=per_action, step_overhead_s=per_step)
    how = (f"fitted by smp-fx calibrate: smp.step on one stage (one process's CPU time), "
           f"a tiny model at {' and '.join(map(str, FIT_MICROBATCHES))} microbatches")
    spec = spec.with_sources(microbatch_overhead_s=how, step_overhead_s=how)
    if world > 1:
        fitted = fit_pipeline(spec, device, args, world)
        if fitted is not None:
            how = (f"fitted by smp-fx calibrate: smp.step at pipeline degree {world} (wall "
                   f"time), a tiny model at {' and '.join(map(str, FIT_MICROBATCHES))} "
                   f"microbatches and the reference transformer at {PIPELINED_MICROBATCHES}, "
                   "jointly (least squares of the relative errors)")
            spec = dataclasses.replace(spec, message_overhead_s=fitted[0],
                                       pipelined_scale=fitted[1]).with_sources(
                message_overhead_s=how, pipelined_scale=how)
    return spec if int(os.environ.get("RANK", "0")) == 0 else None


def _in_step(spec: DeviceSpec, scales: tuple[float, float]) -> DeviceSpec:
    """``spec`` with ``fit_in_step``'s factors folded in: the node scale into both in-place
    factors, the optimizer scale into Adam's figures; the sources say so."""
    nodes, adam = scales
    how = (f"; then x {{:.2f}}, fitted by smp-fx calibrate on the reference transformer's "
           f"training step on one stage ({IN_STEP_MICROBATCHES} microbatches, then Adam) "
           "against its prediction")
    spec = dataclasses.replace(
        spec, compute_scale=spec.compute_scale * nodes,
        overhead_scale=spec.overhead_scale * nodes,
        optimizer_tensor_s=spec.optimizer_tensor_s * adam,
        optimizer_byte_s=spec.optimizer_byte_s * adam)
    return spec.with_sources(**{k: spec.source(k) + how.format(nodes)
                                for k in ("compute_scale", "overhead_scale")},
                             **{k: spec.source(k) + how.format(adam)
                                for k in ("optimizer_tensor_s", "optimizer_byte_s")})


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
