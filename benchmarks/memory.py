"""Activation checkpointing and offloading: bytes kept per stage, step time, overhead.

One MLP of ``--depth`` blocks (Linear, GELU, Dropout), pp 2 in one process (blocks split
evenly by ``smp.set_partition``), ``--microbatches`` microbatches, one intra-op thread.

1. For {none, each, contiguous, group_2, each+offload} x {simple, interleaved}: the bytes
   each stage keeps per microbatch after its forward, counted by the stages' saved-tensor
   hooks (on device; offloaded beside it), the plan's prediction, and the median step time.
2. The checkpointing overhead beside plain ``torch.utils.checkpoint``: smp-fx's
   (checkpointed step / plain step) over torch's (the same model in one process, each block
   under non-reentrant checkpoint, the same microbatches one after another / the plain
   model). A ratio <= 1.05 means smp-fx's checkpointing costs no more than torch's own.
   The four variants run in turn, ``--steps`` steps each, over ``--rounds`` rounds (a shared
   machine's load changes hit them alike); each time is the median of all its steps.
3. Adam's state bytes per rank at pp 1 x dp 2 under ``smp-fx run -n 2``, without and with
   ``shard_optimizer_state`` (sharded: 1/dp of the unsharded state, within one parameter).

    python benchmarks/memory.py [--depth 8 --width 256 --batch 64 --steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smp_fx as smp  # noqa: E402
from cost_model.devices import load_device  # noqa: E402
from smp_fx.marking import activation_checkpointing  # noqa: E402
from smp_fx.world import state  # noqa: E402

CONFIGS = (("none", None, False), ("each", "each", False), ("contiguous", "contiguous", False),
           ("group_2", "group_2", False), ("each+offload", "each", True))


def build(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1))
                           for _ in range(depth)])


def data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(args.batch, args.width, generator=gen),
            torch.randn(args.batch, args.width, generator=gen))


def time_smp(args: argparse.Namespace, strategy: str | None, offload: bool,
             pipeline: str) -> tuple[float, dict[int, Any], Any]:
    """Median step seconds, the saved records of one more (counted) step, and the plan."""
    state._reset()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": args.microbatches,
              "pipeline": pipeline, "auto_partition": False, "default_partition": 0,
              "offload_activations": offload})
    net = build(args.width, args.depth)
    for block in net[args.depth // 2:]:
        smp.set_partition(block, 1)
    model = smp.DistributedModel(net)
    if strategy is not None:
        smp.set_activation_checkpointing(net, strategy=strategy)
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-3))

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = data(args)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        step(model, x, y)
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    for keeper in model.executor.keepers.values():
        keeper.track = True
    step(model, x, y)
    saved = {s: k.records[0] for s, k in model.executor.keepers.items()}
    activation_checkpointing.clear(net)
    return statistics.median(times), saved, model.plan


def torch_stepper(args: argparse.Namespace, checkpointed: bool) -> Callable[[], None]:
    """One training step of the same model in one process, microbatches one after another
    (what the pipeline computes), each block under torch's non-reentrant checkpoint or not."""
    net = build(args.width, args.depth)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = data(args)
    m = args.microbatches

    def forward(v: torch.Tensor) -> torch.Tensor:
        for block in net:
            v = (torch.utils.checkpoint.checkpoint(block, v, use_reentrant=False)
                 if checkpointed else block(v))
        return v

    def run() -> None:
        opt.zero_grad()
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (nn.functional.mse_loss(forward(xm), ym) / m).backward()
        opt.step()

    return run


def smp_stepper(args: argparse.Namespace, strategy: str | None) -> Callable[[], None]:
    """One training step of an smp-fx model (the current configuration), partitioned."""
    net = build(args.width, args.depth)
    for block in net[args.depth // 2:]:
        smp.set_partition(block, 1)
    model = smp.DistributedModel(net)
    if strategy is not None:
        smp.set_activation_checkpointing(net, strategy=strategy)
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-3))
    x, y = data(args)

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    def run() -> None:
        opt.zero_grad()
        step(model, x, y)
        opt.step()

    return run


def overhead(args: argparse.Namespace) -> dict[str, float]:
    """Median step of each variant over ``--rounds`` rounds of ``--steps`` steps, the four
    in turn within a round (rotating which goes first), so that the machine's changing load
    hits them alike. An smp-fx variant is built afresh each round (one model per smp
    session), after a warm-up its partitioning is not timed."""
    torch_runs = {"torch plain": torch_stepper(args, False),
                  "torch checkpoint": torch_stepper(args, True)}
    names = ["torch plain", "torch checkpoint", "smp-fx plain", "smp-fx checkpoint"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % 4:] + names[:r % 4]:
            if name in torch_runs:
                run = torch_runs[name]
            else:
                state._reset()
                smp.init({"pipeline_parallel_degree": 2, "microbatches": args.microbatches,
                          "pipeline": "interleaved", "auto_partition": False,
                          "default_partition": 0})
                run = smp_stepper(args, "each" if name.endswith("checkpoint") else None)
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                run()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def kib(n: int) -> str:
    return f"{n / 1024:8.1f}"


STATE_SCRIPT = """
import json, os, sys
import torch
from torch import nn
import smdistributed.modelparallel.torch as smp

smp.init({"pipeline_parallel_degree": 1, "ddp": True,
          "shard_optimizer_state": sys.argv[1] == "1"})
torch.set_num_threads(1)
torch.manual_seed(0)
width, depth = int(sys.argv[2]), int(sys.argv[3])
model = smp.DistributedModel(nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]))
opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

@smp.step
def train(model, x):
    out = model(x)
    model.backward(out.sum())
    return out

train(model, torch.randn(8, width))
opt.step()
largest = max(p.numel() * p.element_size() for p in model.parameters())
print("STATE " + json.dumps([smp.rank(), opt.local_state_bytes(), largest]), flush=True)
"""


def optimizer_state(args: argparse.Namespace) -> None:
    """Adam's state bytes per rank at pp 1 x dp 2 (``smp-fx run -n 2``), without and with
    ``shard_optimizer_state``: sharded, each rank holds half, within one parameter."""
    print(f"\nAdam state per rank, MLP {args.depth} x Linear({args.width}), pp 1 x dp 2 "
          "(smp-fx run -n 2)")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "state.py"
        script.write_text(STATE_SCRIPT)
        rows = {}
        for shard in (0, 1):
            res = subprocess.run([sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2",
                                  str(script), str(shard), str(args.width), str(args.depth)],
                                 capture_output=True, text=True, timeout=300, cwd=tmp,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            found = sorted(json.loads(line[6:]) for line in res.stdout.splitlines()
                           if line.startswith("STATE "))
            if res.returncode != 0 or len(found) != 2:
                raise RuntimeError(f"the optimizer-state run failed:\n{res.stderr[-2000:]}")
            rows[shard] = found
    full = rows[0][0][1]
    for shard, found in rows.items():
        per_rank = "  ".join(f"rank {r}: {kib(b).strip()} KiB" for r, b, _ in found)
        print(f"{'sharded' if shard else 'unsharded':10s} {per_rank}")
    largest = rows[1][0][2]
    worst = max(abs(b - full / 2) for _, b, _ in rows[1])
    print(f"sharded vs 1/dp of unsharded: off by at most {kib(int(worst)).strip()} KiB "
          f"(one parameter is at most {kib(largest).strip()} KiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_device("cpu")

    print(f"MLP {args.depth} x Linear({args.width}) + GELU + Dropout, batch {args.batch}, "
          f"{args.microbatches} microbatches, pp 2 in one process; KiB per microbatch")
    print(f"{'config':13s} {'pipeline':11s} {'s0 kept':>8s} {'s0 plan':>8s} {'s0 off':>8s} "
          f"{'s1 kept':>8s} {'s1 plan':>8s} {'s1 off':>8s} {'step ms':>8s}")
    for name, strategy, offload in CONFIGS:
        for pipeline in ("simple", "interleaved"):
            t, saved, plan = time_smp(args, strategy, offload, pipeline)
            cells = []
            for s in (0, 1):
                mem = plan.stages[s].memory
                cells += [kib(saved[s].on_device), kib(mem.activations_per_microbatch),
                          kib(saved[s].offloaded)]
            print(f"{name:13s} {pipeline:11s} {' '.join(cells)} {t * 1e3:8.2f}")

    best = overhead(args)
    torch_over = best["torch checkpoint"] / best["torch plain"]
    smp_over = best["smp-fx checkpoint"] / best["smp-fx plain"]
    print()
    for key, value in best.items():
        print(f"{key:18s} {value * 1e3:8.2f} ms")
    print(f"checkpointing overhead: torch {torch_over:.3f}x, smp-fx {smp_over:.3f}x, "
          f"ratio {smp_over / torch_over:.3f} (target <= 1.05)")
    state._reset()
    optimizer_state(args)


if __name__ == "__main__":
    main()
