"""The host's time per microbatch on a GPU: the 1.3B GPT's layers at a width whose kernels
take almost no time.

Why: on a GPU the host queues kernels while earlier ones run, so a microbatch costs about
the larger of its kernels' time and the host's dispatch; the planner prices the host as
hidden, which fails below some microbatch size (docs/planning.md, 'Limits'). This measures
the host's side alone: the GPT of ``benchmarks/plan_gpu.py`` with its 24 layers, sequence,
batch and configuration (full recomputation, bf16 autocast, Adam) at hidden size
``--n-embd`` (default 64), so that each kernel is shorter than its launch and a step is the
host's time. At 1, 2 and 4 microbatches (8, 4 and 2 samples each), eager and, with
``--compile``, at 4 under ``compile: inductor``: the step, the GPU's time in kernels (one
profiled step) and the step per microbatch.

    PYTHONPATH=. python3 benchmarks/host_time.py --compile --out $OUT/host_time.json  # GPU
    PYTHONPATH=. .venv/bin/python benchmarks/host_time.py --tiny                      # CPU

``--calls``: the Python function calls of one step (cProfile) at each microbatch count,
smp-fx's beside a plain PyTorch loop over the same microbatches (``torch.utils.checkpoint``
on each block, autocast, the loss divided by the microbatches, Adam): what smp-fx's own
work adds to the host's. The counts do not depend on the device or its load.

``--tiny`` runs 4 layers on the CPU (the CPU runs its kernels inline: it checks the script).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402  (one fresh training run: gpu_check.train)
import plan_gpu  # noqa: E402


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--compile", action="store_true",
                    help="also the most microbatches under inductor")
    ap.add_argument("--calls", action="store_true",
                    help="Python calls of one step, smp-fx's and a plain loop's")
    ap.add_argument("--calls-only", action="store_true",
                    help="--calls without the timed runs (any device, seconds)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    pargs = plan_gpu.parse(["--tiny"] if args.tiny else [])
    if not args.tiny:
        pargs.n_embd, pargs.n_head, pargs.vocab_size = args.n_embd, args.n_head, args.vocab_size
    pargs.profile, pargs.traces = True, None
    return args, pargs


def plain_step(pargs: argparse.Namespace, microbatches: int, device: torch.device
               ) -> Callable[[], None]:
    """One step of the same training without smp-fx: each block checkpointed
    (``torch.utils.checkpoint``, non-reentrant), the microbatches' losses under bf16
    autocast, each divided by their count before its backward, Adam."""
    from torch.utils.checkpoint import checkpoint

    net = plan_gpu.gpt(pargs, device)
    for block in net.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    ids, target = plan_gpu.batch(pargs, device)

    def step() -> None:
        optimizer.zero_grad()
        for x, y in zip(ids.chunk(microbatches), target.chunk(microbatches), strict=True):
            with torch.autocast(device.type, torch.bfloat16):
                loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            (loss / microbatches).backward()
        optimizer.step()

    return step


def python_calls(step: Callable[[], Any], warmup: int = 3) -> int:
    """Python function calls of one ``step()`` after ``warmup`` others (cProfile)."""
    for _ in range(warmup):
        step()
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]


def call_counts(pargs: argparse.Namespace, best: dict[str, Any], base: dict[str, Any],
                microbatches: list[int], device: torch.device) -> list[dict[str, Any]]:
    """``python_calls`` of smp-fx's step and the plain loop's at each microbatch count."""
    from smp_fx.world import state

    rows = []
    print(f"{'microbatches':<12} {'smp-fx calls':>12} {'plain calls':>11} {'ratio':>6}",
          flush=True)
    for m in microbatches:
        state._reset()
        step, _ = plan_gpu.smp_step(pargs, best, {**base, "microbatches": m}, device)
        ours = python_calls(step)
        state._reset()
        plain = python_calls(plain_step(pargs, m, device))
        rows.append({"microbatches": m, "smp_fx_calls": ours, "plain_calls": plain})
        print(f"{m:<12} {ours:>12} {plain:>11} {ours / plain:>6.3f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args, pargs = parse(argv)
    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    base = {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 1, "ddp": False,
            "pipeline": "interleaved", "optimize": "speed"}
    best = {"recompute": "full"}
    rows: list[dict[str, Any]] = []
    runs: list[tuple[str | None, int]] = [] if args.calls_only else [
        (None, m) for m in args.microbatches]
    if args.compile and runs:  # at the most microbatches: a compile of 24 layers takes a minute
        runs.append(("inductor" if gpu else "aot_eager", max(args.microbatches)))
    plan_gpu.say(f"GPT {pargs.n_layer} x {pargs.n_embd} (heads {pargs.n_head}, vocab "
                 f"{pargs.vocab_size}, seq {pargs.seq_len}), batch {pargs.global_batch}")
    if runs:
        print(f"{'run':<28} {'step ms':>8} {'kernels ms':>10} {'per microbatch ms':>17}",
              flush=True)
    for backend, m in runs:
        cfg = {**base, "microbatches": m, **({"compile": backend} if backend else {})}
        got = gpu_check.train(pargs, best, cfg, device)
        prof = got["profile"]
        row = {"microbatches": m, "samples": pargs.global_batch // m,
               "compile": backend, "step_s": got["step_time_s"],
               "kernels_s": prof["gpu_kernels_s"], "aten_calls": prof["aten_calls"],
               "per_microbatch_s": got["step_time_s"] / m}
        rows.append(row)
        name = f"{m} x mbs {row['samples']}" + (f", {backend}" if backend else ", eager")
        print(f"{name:<28} {row['step_s'] * 1e3:>8.1f} {row['kernels_s'] * 1e3:>10.1f} "
              f"{row['per_microbatch_s'] * 1e3:>17.1f}", flush=True)
        if args.out is not None:
            write(args.out, pargs, device, rows, None)
    calls = (call_counts(pargs, best, base, args.microbatches, device)
             if args.calls or args.calls_only else None)
    if args.out is not None:
        write(args.out, pargs, device, rows, calls)
    return rows


def write(out: Path, pargs: argparse.Namespace, device: torch.device,
          rows: list[dict[str, Any]], calls: list[dict[str, Any]] | None) -> None:
    """The figures so far as JSON (after each run: a run cut short keeps what it has)."""
    out.write_text(json.dumps(
        {"model": {k: getattr(pargs, k) for k in ("n_layer", "n_embd", "n_head", "vocab_size",
                                                  "seq_len", "global_batch")},
         "torch": torch.__version__,
         "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         "rows": rows, "python_calls": calls}, indent=1) + "\n")


if __name__ == "__main__":
    main()
