"""``smp-fx calibrate [-o FILE.json]``: measure this machine into a device spec file.

Parses flags, runs ``smp_fx.calibration`` (through torchrun with ``--nproc``) and writes
or prints the spec. See docs/cli.md, 'smp-fx calibrate'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from cost_model import calibrate as measure
from cost_model.device import DeviceSpec
from cost_model.errors import SMPError, first_line
from cost_model.microbench import FULL
from cost_model.model_sizes import ModelSizes
from smp_fx.calibration.spec import CalibrationOptions, calibrate


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
    p.add_argument("--attention", metavar="HEADSxSEQxDIM",
                   help="also measure at a model's sizes: causal attention at this head "
                        "shape, matmuls up to --matmul-max in --dtype, bandwidth, Adam "
                        "(default on an accelerator: 16x1024x128, the 1.3B GPT's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="the model's dtype (default: bfloat16 on an accelerator, else "
                        "float32)")
    p.add_argument("--matmul-max", type=int,
                   help="largest matmul dimension measured at the model's sizes (default: "
                        "8192 on an accelerator, else 512)")
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
        spec = calibrate(options(args), world)
    except SMPError as exc:
        print(f"smp-fx calibrate: error: {first_line(exc)}", file=sys.stderr)
        return 2
    if spec is not None:
        _report(spec, args.output)
    return 0


def options(args: argparse.Namespace) -> CalibrationOptions:
    """The library's options from the parsed flags."""
    return CalibrationOptions(name=args.name, device=args.device, quick=args.quick,
                              steps=args.steps, sizes=_sizes(args))


def _sizes(args: argparse.Namespace) -> ModelSizes | None:
    """The model's sizes from the flags; the CPU's defaults are sizes it measures in
    seconds (``FULL``'s element-wise and Adam sizes, matmuls up to 512)."""
    accelerator = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu"
    if args.attention is None and args.dtype is None and args.matmul_max is None:
        return None  # the library's default: the 1.3B GPT's on an accelerator
    extra: dict[str, object] = {"dtype": args.dtype or ("bfloat16" if accelerator
                                                       else "float32")}
    if not accelerator:
        extra.update(elementwise_bytes=FULL.elementwise_bytes, adam_sizes=FULL.adam_sizes)
    top = args.matmul_max or (8192 if accelerator else 512)
    extra["matmul_dims"] = tuple(d for d in ModelSizes().matmul_dims if d < top) + (top,)
    return ModelSizes.parse(args.attention or "16x1024x128", **extra)


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
