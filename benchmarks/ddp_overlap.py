"""Step time with and without overlapping the data-parallel reduction (``ddp: true``).

4 processes by default, pp=2 x dp=2 ("cluster"), gloo on CPU (or NCCL when there is one GPU
per process). The model is an MLP chain large enough that the gradient all-reduce is a
visible part of a step. Each process trains the same model twice, once with
``overlapping_allreduce=True`` (buckets are reduced while the stage's last microbatch's
backward still runs) and once with ``False`` (all buckets reduced after the step), and
rank 0 prints the median, 10th and 90th percentile step times side by side, and the time
of the bucketed reduction alone (the most overlapping can hide); a step time is the
slowest rank's. The modes alternate in phases (a fresh model each: smp allows one at
a time) to share the machine's noise; the first step of a phase (partitioning) and
``--warmup`` more are not timed.

Run: ``.venv/bin/python benchmarks/ddp_overlap.py [--steps 20 --hidden 1024 ...]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def build(hidden: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(hidden, 10))


def _worker(args: argparse.Namespace) -> Any:
    """This rank's part (one of ``run_ranks``'s): the figures, the slowest rank's times."""
    torch.set_num_threads(args.threads)
    import smp_fx as smp
    from smp_fx.world import state

    smp.init({"pipeline_parallel_degree": args.pp, "microbatches": args.microbatches,
              "pipeline": args.pipeline, "ddp": True, "placement_strategy": "cluster"})
    per_rank = args.batch // smp.dp_size()
    torch.manual_seed(0)
    x = torch.randn(per_rank, args.hidden, device=state.get().device)
    y = torch.randint(0, 10, (per_rank,), device=state.get().device)
    times: dict[str, list[float]] = {"overlap": [], "end of step": []}
    group = smp.get_world_process_group()
    per_round = -(-args.steps // args.rounds)
    for _ in range(args.rounds):
        for name, overlap in (("overlap", True), ("end of step", False)):
            # smp allows one DistributedModel at a time: a fresh one per phase
            torch.manual_seed(0)
            model = smp.DistributedModel(build(args.hidden, args.layers),
                                         overlapping_allreduce=overlap,
                                         bucket_cap_mb=args.bucket_cap_mb)
            opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

            @smp.step
            def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
                loss = nn.functional.cross_entropy(model(x), y)
                model.backward(loss)
                return loss

            for i in range(args.warmup + per_round):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                train_step(model, x, y)
                opt.step()
                opt.zero_grad()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
                if i >= args.warmup:
                    times[name].append(took.item())
    # the reduction alone (what overlapping can hide at best): the last model's buckets
    from smp_fx.parallel.ddp import allreduce_grads

    dp = model.parallelized.data_parallel
    times["reduction alone"] = []
    for _ in range(args.steps):
        for p in model.local_parameters():
            p.grad = torch.ones_like(p)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for s in sorted(dp.runners):
            allreduce_grads(dp.bucket_lists[s], dp.group, dp.size)
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
        times["reduction alone"].append(took.item())
    params = sum(p.numel() for p in build(args.hidden, args.layers).parameters())
    return params, times


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--pipeline", default="interleaved")
    ap.add_argument("--bucket-cap-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per phase")
    ap.add_argument("--rounds", type=int, default=2, help="phases per mode, alternating")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = ap.parse_args()
    if args.steps < 10:
        ap.error("--steps must be >= 10 (medians of at least 10 steps)")
    sys.path.insert(0, str(ROOT))
    from tests.helpers.dist import run_ranks

    params, times = run_ranks(_worker, args.world, args, timeout=1800)[0]
    dp = args.world // args.pp
    print(f"pp={args.pp} x dp={dp} on {args.world} processes, {params / 1e6:.1f} M params "
          f"({params * 4 / 2**20:.0f} MiB fp32), hidden {args.hidden} x {args.layers} layers, "
          f"global batch {args.batch}, {args.microbatches} microbatches ({args.pipeline}), "
          f"buckets {args.bucket_cap_mb} MiB, {args.threads} thread(s)/process, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"{'reduction':14s} {'median ms':>10s} {'p10 ms':>8s} {'p90 ms':>8s} {'steps':>6s}")
    med = {}
    for name, ts in times.items():
        med[name] = statistics.median(ts)
        print(f"{name:14s} {med[name] * 1e3:10.1f} {_pct(ts, 0.1) * 1e3:8.1f} "
              f"{_pct(ts, 0.9) * 1e3:8.1f} {len(ts):6d}")
    print(f"(the reduction alone takes {med['reduction alone'] * 1e3:.1f} ms: the most "
          "overlapping can hide)")
    print(f"overlap saves {(1 - med['overlap'] / med['end of step']) * 100:.1f}% "
          "of the step time (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
