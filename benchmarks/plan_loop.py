"""The planning loop on this machine: plan for 8 CPU processes, emit, run, compare.

1. ``smp-fx plan`` the GPT example for 8 processes on the ``cpu`` spec (or ``--device
   FILE.json`` from ``smp-fx calibrate``) with ``--emit-config`` (the search keeps to what
   the runtime runs today) and ``--json``;
2. ``smp-fx run -n 8 --config cfg.json examples/train_planned.py --plan plan.json``, which
   also trains the unpartitioned model in plain PyTorch on rank 0 (``--reference``);
3. prints the plan's predicted step and memory per process beside the measured ones (median
   step of each rank, the slowest rank's; bytes held, the largest rank's; peak RSS) and
   the largest loss difference from plain PyTorch.

    .venv/bin/python benchmarks/plan_loop.py                       # the planner's pick
    .venv/bin/python benchmarks/plan_loop.py --fix pp=2,tp=2,dp=2  # a given plan
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMP_FX = str(Path(sys.executable).with_name("smp-fx"))
SIZES = {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 128, "seq_len": 32}


def plan_command(device: str, gpus: int, global_batch: int, fix: str, cfg: Path,
                 plan_json: Path) -> list[str]:
    """``smp-fx plan`` of the GPT example at ``SIZES`` for ``gpus`` processes, fp32."""
    build = [x for k, v in SIZES.items() for x in ("--build-arg", f"{k}={v}")]
    build += ["--inputs-arg", f"seq_len={SIZES['seq_len']}", "--inputs-arg",
              f"vocab_size={SIZES['vocab_size']}"]
    cmd = [SMP_FX, "plan", str(ROOT / "examples/models/gpt.py"), *build, "--device",
           device, "--gpus", str(gpus), "--global-batch", str(global_batch), "--precision",
           "fp32", "--emit-config", str(cfg), "--json", str(plan_json), "--top", "3",
           "--quiet"]
    return cmd + (["--fix", fix] if fix else [])


def train_command(gpus: int, cfg: Path, plan_json: Path, global_batch: int, steps: int,
                  *extra: str) -> list[str]:
    """``smp-fx run`` of ``examples/train_planned.py`` under the plan, at ``SIZES``."""
    train = [SMP_FX, "run", "-n", str(gpus), "--config", str(cfg),
             str(ROOT / "examples/train_planned.py"), "--plan", str(plan_json),
             "--global-batch", str(global_batch), "--steps", str(steps), *extra]
    for key, value in SIZES.items():
        train += [f"--{key.replace('_', '-')}", str(value)]
    return train


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fix", default="")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="plan_loop_"))
    cfg, plan_json, out = work / "cfg.json", work / "plan.json", work / "figures"
    cmd = plan_command(args.device, 8, args.global_batch, args.fix, cfg, plan_json)
    print("$", " ".join(cmd[1:]), flush=True)
    print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout, flush=True)
    train = train_command(8, cfg, plan_json, args.global_batch, args.steps, "--reference",
                          "--out", str(out))
    print("$", " ".join(train[1:]), flush=True)
    subprocess.run(train, check=True, capture_output=True, text=True)
    best = json.loads(plan_json.read_text())["best"]
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    mem = best["details"]["memory"]
    state_act = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
    held = max(r["memory"]["total"] for r in ranks)
    step = max(r["step_time_s"] for r in ranks)
    diff = max(r.get("max_loss_difference", 0.0) for r in ranks)
    print(f"plan: tp {best['tp']} pp {best['pp']} dp {best['dp']} mbs {best['mbs']} "
          f"m {best['microbatches']} {best['schedule']} recompute {best['recompute']} "
          f"sp {best['sp']} zero {best['zero']}")
    print(f"step time:  predicted {best['step_time_s'] * 1e3:8.2f} ms   measured "
          f"{step * 1e3:8.2f} ms (slowest rank's median of {args.steps - 1})   ratio "
          f"{step / best['step_time_s']:.2f}")
    print(f"memory:     predicted {state_act / 1024:8.1f} KiB (state + activations; "
          f"{mem['total'] / 1024:.1f} KiB with buffers and outputs)   measured "
          f"{held / 1024:8.1f} KiB (largest rank)   ratio {held / state_act:.3f}")
    print(f"peak RSS per process: {max(r['peak_rss_bytes'] for r in ranks) / 2**20:.0f} MiB "
          "(the torch runtime itself; not a plan figure)")
    print(f"largest loss difference from plain PyTorch over {args.steps} steps: {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
