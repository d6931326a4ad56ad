"""smp-fx's per-step overhead at pipeline_parallel_degree 1, one process.

The same MLP and batch trained by a plain PyTorch step (forward, loss, backward) and by an
``smp.step`` function (1 microbatch), alternating step by step (and which goes first) so
load changes on a shared machine hit both alike; median of ``--steps`` steps each, one
intra-op thread.

    python benchmarks/overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model(width: int, depth: int) -> nn.Module:
    """The MLP example at benchmark size: ``depth`` Linear(width)+ReLU blocks and a head."""
    from smp_fx.cli.partition import load_model_file

    mlp = load_model_file(str(Path(__file__).resolve().parents[1] / "examples/models/mlp.py"))
    return mlp.build_model(in_features=width, hidden=width, num_blocks=depth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    import smp_fx as smp

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 1, "microbatches": args.microbatches})
    torch.manual_seed(0)
    plain = build_model(args.width, args.depth)
    wrapped = build_model(args.width, args.depth)
    wrapped.load_state_dict(plain.state_dict())
    model = smp.DistributedModel(wrapped)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    def plain_step() -> None:
        m = args.microbatches
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            (F.cross_entropy(plain(xm), ym) / m).backward()

    smp_t: list[float] = []
    torch_t: list[float] = []
    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for i in range(args.warmup + args.steps):
        first_smp = i % 2 == 0  # alternate which one runs first (cache and clock effects)
        a = timed(lambda: train_step(model, x, y)) if first_smp else timed(plain_step)
        b = timed(plain_step) if first_smp else timed(lambda: train_step(model, x, y))
        if i >= args.warmup:
            smp_t.append(a if first_smp else b)
            torch_t.append(b if first_smp else a)
    s, t = statistics.median(smp_t), statistics.median(torch_t)
    print(f"MLP width {args.width} depth {args.depth}, batch {args.batch}, "
          f"{args.microbatches} microbatch(es), pp 1, one process, 1 thread, "
          f"median of {args.steps} steps")
    print(f"plain PyTorch step {t * 1e3:8.2f} ms")
    print(f"smp.step          {s * 1e3:8.2f} ms")
    print(f"overhead          {100 * (s / t - 1):+7.1f} %  ({(s - t) * 1e6:.0f} us per step)")


if __name__ == "__main__":
    main()
