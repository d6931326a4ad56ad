"""smp-fx's pipeline against torch.distributed.pipelining, same work, one run.

Two gloo processes with one intra-op thread each. The model is an MLP chain; smp-fx
partitions it at its first step and torch's ``PipelineStage`` is built from the very same
stage GraphModules, so both run the same stage split, microbatch count and schedule
(simple = ``ScheduleGPipe``, interleaved = ``Schedule1F1B``). Each configuration runs a few
warm-up steps, then two measures of a training step (forward, loss, backward for every
microbatch; the optimizer step is excluded from both), smp-fx and torch alternating:

- *latency*: the median of ``--steps`` single steps, each between two barriers;
- *throughput*: the median, over blocks of ``--block`` steps run back to back (as in
  training), of the time per step.

Each measure prints the ratio of the two medians and, because a shared 2-core machine
drifts by several percent within a run, the median of the paired ratios (each smp-fx
step or block over the torch one measured right after it).

    python benchmarks/pipeline_vs_torch.py            # prints a table and the ratios
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
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model(width: int, depth: int) -> nn.Module:
    """The MLP example at benchmark size: ``depth`` Linear(width)+ReLU blocks and a head."""
    from smp_fx.cli.partition import load_model_file

    mlp = load_model_file(str(Path(__file__).resolve().parents[1] / "examples/models/mlp.py"))
    return mlp.build_model(in_features=width, hidden=width, num_blocks=depth)


def _barrier_time(fn: Any) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _smp_step(args: argparse.Namespace, pipeline: str) -> tuple[Any, Any]:
    import smp_fx as smp
    from smp_fx.world import state

    state._reset()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": args.microbatches,
              "pipeline": pipeline, "active_microbatches": args.microbatches})
    torch.manual_seed(0)
    model = smp.DistributedModel(build_model(args.width, args.depth))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = model(x)
        loss = F.cross_entropy(out, y)
        model.backward(loss)
        return loss

    return model, train_step


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """The stage module returns a tuple (its sent values); the logits are its only one."""
    return F.cross_entropy(out[0] if isinstance(out, tuple) else out, target)


def _torch_step(args: argparse.Namespace, pipeline: str, program: Any) -> Any:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    stage = PipelineStage(program.stages[rank].module, rank, 2, torch.device("cpu"))
    cls = ScheduleGPipe if pipeline == "simple" else Schedule1F1B
    return cls(stage, args.microbatches, loss_fn=_loss)


def _compare(args: argparse.Namespace, pipeline: str, x: torch.Tensor,
             y: torch.Tensor) -> tuple[list[float], list[float], list[float], list[float]]:
    """Step latencies and times per step back to back: (smp-fx, torch, smp-fx, torch), the
    two alternating (shared machine: alternating keeps load changes from favouring
    either)."""
    model, train_step = _smp_step(args, pipeline)
    train_step(model, x, y)  # partitions
    sched = _torch_step(args, pipeline, model.program)
    rank = dist.get_rank()

    def torch_run() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])

    smp_t, torch_t = [], []
    for i in range(args.warmup + args.steps):
        a = _barrier_time(lambda: train_step(model, x, y))
        b = _barrier_time(torch_run)
        if i >= args.warmup:
            smp_t.append(a)
            torch_t.append(b)
    k = args.block
    smp_b, torch_b = [], []
    for _ in range(_blocks(args)):
        smp_b.append(_barrier_time(lambda: [train_step(model, x, y) for _ in range(k)]) / k)
        torch_b.append(_barrier_time(lambda: [torch_run() for _ in range(k)]) / k)
    return smp_t, torch_t, smp_b, torch_b


def _blocks(args: argparse.Namespace) -> int:
    return max(args.steps // args.block, 10)


def _worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    dist.init_process_group("gloo")
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, 10, (args.batch,))
    rows = []
    for pipeline in ("simple", "interleaved"):
        rows.append((pipeline, *_compare(args, pipeline, x, y)))
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block", type=int, default=3, help="steps per back-to-back block "
                    "(at least 10 blocks are timed)")
    ap.add_argument("--pin", action="store_true",
                    help="pin rank r (and all its threads) to core r")
    args = ap.parse_args()
    from tests.helpers.dist import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    print(f"MLP width {args.width} depth {args.depth}, batch {args.batch}, "
          f"{args.microbatches} microbatches, 2 gloo processes x 1 thread, "
          f"latency: median of {args.steps} steps; throughput: median of "
          f"{_blocks(args)} blocks of {args.block}"
          + (", ranks pinned to cores" if args.pin else ""))
    print(f"{'schedule':<12} {'measure':<11} {'smp-fx ms':>10} {'torch ms':>10} "
          f"{'smp/torch':>10} {'paired':>8}")
    for pipeline, s, t, sb, tb in rows:
        for what, a, b in (("latency", s, t), ("throughput", sb, tb)):
            ma, mb = statistics.median(a), statistics.median(b)
            paired = statistics.median(x / y for x, y in zip(a, b))
            print(f"{pipeline:<12} {what:<11} {ma * 1e3:>10.2f} {mb * 1e3:>10.2f} "
                  f"{ma / mb:>10.3f} {paired:>8.3f}")


if __name__ == "__main__":
    main()
