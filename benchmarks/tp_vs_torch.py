"""Tensor parallelism, smp-fx against ``torch.distributed.tensor.parallel``, same model.

An MLP of ``--blocks`` residual blocks (``width -> 4 x width -> width``, GELU between) at
tensor-parallel degree 2 on 2 gloo processes, both ranks on the same batch (smp-fx's
``prescaled_batch: true``, which is what torch's plan computes):

* smp-fx: the blocks marked with ``smp.tensor_parallelism()``, the automatic column ->
  row rewrite (``passes/tensor_parallel/rewrite.py``), ``smp.step``, ``DistributedOptimizer``;
* torch: ``parallelize_module`` with a hand-written plan (``ColwiseParallel`` for each
  block's first linear, ``RowwiseParallel`` for its second) on a 1-D ``DeviceMesh``.

A training step is ``zero_grad``, forward, loss, backward and an Adam step. The two are
alternated in rounds in one run (each round: ``--steps`` steps of one, then of the
other); the medians and the smp-fx / torch ratio are printed (target <= 1.0). Then the
parameter bytes each rank holds beside what smp-fx's tensor-parallel plan predicts:
sharded parameters / tp + replicated ones.

``--optimize speed`` (default) is the comparable setting: torch's plan has no sequence
parallelism. ``--optimize memory`` shows what chunking costs here (a reduce-scatter
and an all-gather per pair boundary instead of one all-reduce; on 2 cores the slicing
and the extra calls cost more than the halved activations save).

    python benchmarks/tp_vs_torch.py                 # about a minute
    python benchmarks/tp_vs_torch.py --width 256 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, width: int, blocks: int, marked: bool) -> None:
        super().__init__()
        import smp_fx as smp

        if marked:
            with smp.tensor_parallelism():
                self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        else:
            self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _smp_runner(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True,
              "prescaled_batch": True, "microbatches": 1, "optimize": args.optimize})
    torch.manual_seed(0)
    model = smp.DistributedModel(MLP(args.width, args.blocks, marked=True))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    def step() -> None:
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()

    return step, model


def _torch_runner(args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = MLP(args.width, args.blocks, marked=False)
    mesh = init_device_mesh("cpu", (2,))
    plan: dict[str, Any] = {}
    for i in range(args.blocks):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step, model


def _local_bytes(model: Any) -> int:
    """Bytes of the parameters this rank trains: smp-fx's stage parameters (the wrapped
    module's own full tensors stay where the user built them, as in SMP), torch's local
    DTensor shards."""
    params = model.local_parameters() if hasattr(model, "local_parameters") else \
        model.parameters()
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    """Runs under ``smp-fx run -n 2``: both runners, alternated; rank 0 prints JSON."""
    import torch.distributed as dist

    import smp_fx as smp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))
    smp_step, smp_model = _smp_runner(args, x, y)
    torch_step, torch_model = _torch_runner(args, x, y)
    for step in (smp_step, torch_step):
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {"smp": [], "torch": []}
    for _ in range(args.rounds):
        for name, step in (("smp", smp_step), ("torch", torch_step)):
            dist.barrier()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    plan = smp_model.tp_plan
    sharded = {s.name: s for s in plan.sharded}
    full = dict(MLP(args.width, args.blocks, marked=False).named_parameters())
    predicted = sum(math.prod(p.shape) * 4 // (sharded[n].parts if n in sharded else 1)
                    for n, p in full.items())
    if smp.rank() == 0:
        print("RESULT " + json.dumps({
            "smp": times["smp"], "torch": times["torch"],
            "smp_bytes": _local_bytes(smp_model), "torch_bytes": _local_bytes(torch_model),
            "predicted_bytes": predicted, "sharded": len(plan.sharded),
            "replicated": [list(r) for r in plan.replicated],
            "full_bytes": sum(p.numel() * 4 for p in full.values())}), flush=True)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--optimize", choices=("speed", "memory"), default="speed",
                    help="smp-fx's optimize: speed matches torch's plan (activations between "
                         "the pairs replicated); memory chunks them by sequence")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2", __file__, "--worker",
           *[f"--{k}={getattr(args, k)}" for k in ("width", "blocks", "batch", "rounds",
                                                   "steps", "warmup", "optimize")]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(lines[0][len("RESULT "):])
    s, t = statistics.median(r["smp"]), statistics.median(r["torch"])
    print(f"MLP {args.blocks} x ({args.width} -> {4 * args.width} -> {args.width}), batch "
          f"{args.batch}, tp=2 on 2 gloo processes, {args.rounds} alternated rounds of "
          f"{args.steps} steps:")
    print(f"  training step, median: smp-fx {s * 1e3:.2f} ms, torch TP {t * 1e3:.2f} ms, "
          f"ratio {s / t:.3f} (target <= 1.0)")
    print(f"  parameter bytes per rank: smp-fx {r['smp_bytes'] / 2**20:.2f} MiB, torch "
          f"{r['torch_bytes'] / 2**20:.2f} MiB; smp-fx plan predicts "
          f"{r['predicted_bytes'] / 2**20:.2f} MiB (sharded / 2 + replicated; "
          f"{r['sharded']} sharded tensors; the whole model {r['full_bytes'] / 2**20:.2f} MiB)")
    for region, why in r["replicated"]:
        print(f"  replicated: {region}: {why}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
