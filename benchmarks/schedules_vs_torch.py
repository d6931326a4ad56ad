"""Every smp-fx pipeline schedule beside torch.distributed.pipelining's counterpart.

On 2 and 4 gloo processes (one intra-op thread each) the same model, split the same way
(torch's ``PipelineStage``s are built from smp-fx's own chunk GraphModules, placed as smp-fx
places them), runs one training step (forward, a sum loss, backward; no optimizer step)
under each pair of schedules:

    simple      v=1  ScheduleGPipe                   interleaved v=1  Schedule1F1B
    simple      v=2  ScheduleLoopedBFS               interleaved v=2  ScheduleInterleaved1F1B
    zero_bubble v=1  ScheduleInterleavedZeroBubble   zero_bubble v=2  ScheduleInterleavedZeroBubble
    zbv         v=2  ScheduleZBVZeroBubble

The model makes per-op costs deterministic, so the bubble is measurable on a noisy 2-core
machine: 2p blocks, each a small Linear whose forward sleeps ``--sleep-ms``, with an
identity on its input whose backward sleeps as long (the input-gradient path) and an
identity on its weight whose backward sleeps as long (the weight-gradient path; the first
block's input needs no gradient, so it has no input-gradient sleep). Every sleep records its
start and end: a rank's busy time is the sum, and the measured bubble of a step is
``1 - sum(busy) / (ranks x step)``, for smp-fx and torch alike, beside the simulator
(``cost_model.simulate``) running the same lists with each chunk priced by its sleeps alone
("sim0": what the time between sleeps, transfers and turns included, adds shows as their
difference). For smp-fx the bubble is also taken from per-action timestamps (its flight
record: each F, B, I and W op's duration, overheads included), beside the simulator with
each chunk's actions priced by their median measured duration: the two differ only by what
the executor adds between actions. Each figure is the fastest of
``--retries`` steps after a warm-up step, smp-fx's and torch's alternating.

Then the real-compute MLP of ``benchmarks/pipeline_vs_torch.py`` (no sleeps) at the same
world size under each schedule (target: smp-fx's step <= torch's on each).

    python benchmarks/schedules_vs_torch.py                 # both world sizes, all schedules
    python benchmarks/schedules_vs_torch.py --ranks 4 --retries 2
    python benchmarks/schedules_vs_torch.py --ranks 2 --schedules none   # the MLP only
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAIRS = (  # smp-fx pipeline, virtual_pipeline_degree, torch.distributed.pipelining class
    ("simple", 1, "ScheduleGPipe"),
    ("interleaved", 1, "Schedule1F1B"),
    ("simple", 2, "ScheduleLoopedBFS"),
    ("interleaved", 2, "ScheduleInterleaved1F1B"),
    ("zero_bubble", 1, "ScheduleInterleavedZeroBubble"),
    ("zero_bubble", 2, "ScheduleInterleavedZeroBubble"),
    ("zbv", 2, "ScheduleZBVZeroBubble"),
)
SINGLE = ("ScheduleGPipe", "Schedule1F1B")  # torch classes taking one stage per rank
MLP_MICROBATCHES = 4  # pipeline_vs_torch.py's default

_SPANS: list[tuple[float, float]] = []  # this process's sleeps in the running step
_SPANS_LOCK = threading.Lock()


def _sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    with _SPANS_LOCK:
        _SPANS.append((start, time.perf_counter()))


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``fwd_s`` and whose backward sleeps ``bwd_s``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        if fwd_s:
            _sleep(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.bwd_s:
            _sleep(ctx.bwd_s)
        return grad, None, None


def sleep_id(x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
    """``_Sleep`` as one graph node (``torch.fx.wrap``): tracing keeps the call."""
    return _Sleep.apply(x, fwd_s, bwd_s)


torch.fx.wrap("sleep_id")


class SleepBlock(nn.Module):
    """A Linear with a forward sleep, an input-gradient sleep and a weight-gradient sleep."""

    def __init__(self, width: int, sleep_s: float) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = sleep_id(x, self.sleep_s, self.sleep_s)
        w = sleep_id(self.lin.weight, 0.0, self.sleep_s)
        return F.linear(x, w, self.lin.bias)


@dataclass
class Row:
    """One schedule pair at one world size (seconds; bubbles as fractions)."""

    pipeline: str
    v: int
    torch_name: str
    smp_s: float
    torch_s: float
    smp_bubble: float
    torch_bubble: float
    action_bubble: float
    sim_bubble: float
    sim_s: float
    sleep_sim_bubble: float


Durations = dict[tuple[int, str], list[float]]
"""(chunk, kind) -> seconds of each such action of a step (smp-fx's flight record)."""


def _timed(step: Callable[[], Any], ranks: int, executor: Any = None
           ) -> tuple[float, float, Durations]:
    """One step between barriers: (seconds, measured bubble, every rank's action durations
    when ``executor``, smp-fx's, is given); the bubble from every rank's sleeps."""
    with _SPANS_LOCK:
        _SPANS.clear()
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dist.barrier()
    seconds = time.perf_counter() - t0
    with _SPANS_LOCK:
        busy = sum(b - a for a, b in _SPANS)
    mine: Durations = {}
    if executor is not None:  # each action op lasts until the next op starts
        flight = executor.flight
        for i, op in enumerate(flight.ops):
            if op.kind in ("F", "B", "I", "W"):
                mine.setdefault((op.stage, op.kind), []).append(
                    flight.starts[i + 1] - flight.starts[i])
    everyone: list[Any] = [None] * ranks
    dist.all_gather_object(everyone, (seconds, busy, mine))
    step_s = max(s for s, _, _ in everyone)
    durations: Durations = {}
    for _, _, d in everyone:
        for key, values in d.items():
            durations.setdefault(key, []).extend(values)
    return step_s, 1.0 - sum(b for _, b, _ in everyone) / (ranks * step_s), durations


def _alternating(smp_step: Callable[[], Any], torch_step: Callable[[], Any], ranks: int,
                 retries: int, executor: Any
                 ) -> tuple[tuple[float, float, Durations], tuple[float, float, Durations],
                            float]:
    """The fastest of ``retries`` steps of each after one warm-up each, the two alternating
    (a shared machine's load changes then favour neither), and the median of the paired
    ratios (each smp-fx step over the torch step right after it), which load that changes
    within the run biases less than it does the fastest steps."""
    smp_step()
    torch_step()
    best_smp = best_torch = None
    paired = []
    for _ in range(retries):
        a = _timed(smp_step, ranks, executor)
        b = _timed(torch_step, ranks)
        paired.append(a[0] / b[0])
        best_smp = a if best_smp is None or a[0] < best_smp[0] else best_smp
        best_torch = b if best_torch is None or b[0] < best_torch[0] else best_torch
    assert best_smp is not None and best_torch is not None
    return best_smp, best_torch, statistics.median(paired)


def _smp_model(m: int, pipeline: str, v: int, model: nn.Module, active: int | None = None
               ) -> tuple[Any, Any]:
    import smp_fx as smp
    from smp_fx.world import state

    state._reset()
    cfg = {"pipeline_parallel_degree": dist.get_world_size(), "microbatches": m,
           "pipeline": pipeline, "virtual_pipeline_degree": v, "memory_weight": 0.0}
    if active is not None:
        cfg["active_microbatches"] = active
    smp.init(cfg)
    dm = smp.DistributedModel(model)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = F.cross_entropy(model(x), y) if y.dtype == torch.long else model(x).sum()
        model.backward(loss)
        return loss

    return dm, train_step


def _torch_schedule(name: str, program: Any, rank_of: tuple[int, ...], m: int,
                    loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
                    wrap: Callable[[nn.Module], nn.Module] | None = None) -> Any:
    """torch's ``name`` schedule over smp-fx's own chunk modules, placed as ``rank_of``
    places them (each module passed through ``wrap`` first, e.g. ``torch.compile``)."""
    from torch.distributed.pipelining import PipelineStage, schedules

    rank = dist.get_rank()
    mine = [c for c, r in enumerate(rank_of) if r == rank]
    modules = [program.stages[c].module for c in mine]
    stages = [PipelineStage(wrap(mod) if wrap else mod, c, len(rank_of), torch.device("cpu"))
              for c, mod in zip(mine, modules)]
    cls = getattr(schedules, name)
    return cls(stages[0] if name in SINGLE else stages, m, loss_fn=loss or _loss)


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    out = out[0] if isinstance(out, tuple) else out
    return F.cross_entropy(out, target) if target.dtype == torch.long else out.sum()


def _torch_step(sched: Any, rank_of: tuple[int, ...], x: torch.Tensor,
                y: torch.Tensor) -> Callable[[], None]:
    rank = dist.get_rank()
    first, last = rank_of[0] == rank, rank_of[-1] == rank

    def run() -> None:
        kwargs: dict[str, Any] = {"target": y, "losses": []} if last else {}
        if first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)

    return run


def _sleep_costs(program: Any) -> list[Any]:
    """Each chunk's F, I and W priced by its sleeps alone (no executor, no transfers)."""
    from cost_model.simulate import StageCost

    costs = []
    for st in program.stages:
        f = i = w = 0.0
        for node in st.module.graph.nodes:
            if node.op == "call_function" and node.target is sleep_id:
                fwd_s, bwd_s = float(node.args[1]), float(node.args[2])
                f += fwd_s
                if node.args[0].op == "get_attr":
                    w += bwd_s
                elif node.args[0].op != "placeholder" or st.index > 0:
                    i += bwd_s
        costs.append(StageCost(f, i + w, wgrad_time_s=w))
    return costs


def _simulated(pipeline: str, v: int, p: int, m: int, rank_of: tuple[int, ...],
               durations: Durations) -> tuple[float, float]:
    """The simulator on the same lists, each chunk's actions priced by their measured
    median durations (the step the smp-fx figures come from)."""
    from cost_model.schedule import generate
    from cost_model.simulate import StageCost, simulate

    def med(c: int, kind: str) -> float:
        values = durations.get((c, kind), [])
        return statistics.median(values) if values else 0.0

    costs = []
    for c in range(len(rank_of)):
        if (c, "B") in durations:
            costs.append(StageCost(med(c, "F"), med(c, "B")))
        else:
            costs.append(StageCost(med(c, "F"), med(c, "I") + med(c, "W"),
                                   wgrad_time_s=med(c, "W")))
    result = simulate(generate(pipeline, p, m, m, virtual_stages=v, placement=rank_of), costs)
    return result.bubble_fraction, result.step_time_s


def _sleep_rows(args: argparse.Namespace) -> list[Row]:
    from cost_model.schedule import generate
    from cost_model.simulate import simulate

    p, m = dist.get_world_size(), args.microbatches
    rows = []
    for pipeline, v, torch_name in PAIRS:
        if args.schedules and f"{pipeline}:{v}" not in args.schedules:
            continue
        torch.manual_seed(0)
        model = nn.Sequential(*[SleepBlock(args.width, args.sleep_ms / 1e3)
                                for _ in range(2 * p)])
        x = torch.randn(args.batch, args.width)
        y = torch.zeros(args.batch)  # the sum loss ignores it
        dm, train_step = _smp_model(m, pipeline, v, model, active=m)
        train_step(dm, x, y)  # partitions
        program, rank_of = dm.program, tuple(dm.plan.rank_of)
        sched = _torch_schedule(torch_name, program, rank_of, m)
        (smp_s, smp_bubble, durations), (torch_s, torch_bubble, _), _ = _alternating(
            functools.partial(train_step, dm, x, y), _torch_step(sched, rank_of, x, y), p,
            args.retries, dm.executor)
        sim_bubble, sim_s = _simulated(pipeline, v, p, m, rank_of, durations)
        busy = sum(sum(values) for values in durations.values())
        sleep_sim = simulate(generate(pipeline, p, m, m, virtual_stages=v, placement=rank_of),
                             _sleep_costs(program)).bubble_fraction
        rows.append(Row(pipeline, v, torch_name, smp_s, torch_s, smp_bubble, torch_bubble,
                        1.0 - busy / (p * smp_s), sim_bubble, sim_s, sleep_sim))
    return rows


def _mlp_rows(args: argparse.Namespace) -> list[tuple[str, int, str, float, float, float]]:
    """The real-compute MLP of pipeline_vs_torch.py at this world size under each schedule."""
    from benchmarks.pipeline_vs_torch import build_model

    rows = []
    torch.manual_seed(1)
    x = torch.randn(args.mlp_batch, 512)
    y = torch.randint(0, 10, (args.mlp_batch,))
    for pipeline, v, torch_name in PAIRS:
        torch.manual_seed(0)
        dm, train_step = _smp_model(MLP_MICROBATCHES, pipeline, v, build_model(512, 8),
                                    active=MLP_MICROBATCHES)
        train_step(dm, x, y)  # partitions
        program, rank_of = dm.program, tuple(dm.plan.rank_of)
        sched = _torch_schedule(torch_name, program, rank_of, MLP_MICROBATCHES)
        (smp_s, _, _), (torch_s, _, _), paired = _alternating(
            functools.partial(train_step, dm, x, y), _torch_step(sched, rank_of, x, y),
            dist.get_world_size(), args.retries * 3, None)
        rows.append((pipeline, v, torch_name, smp_s, torch_s, paired))
    return rows


def _worker(rank: int, world: int, port: int, body: Callable[[argparse.Namespace], Any],
            args: argparse.Namespace, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = body(args)
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(world: int, body: Callable[[argparse.Namespace], Any],
                args: argparse.Namespace, timeout: float) -> Any:
    """``body(args)`` on ``world`` fresh gloo ranks, one thread each; rank 0's result."""
    from tests.helpers.dist import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, body, args, out))
             for r in range(world)]
    for proc in procs:
        proc.start()
    result = out.get(timeout=timeout)
    for proc in procs:
        proc.join(timeout=120)
    return result


def _schedules(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"sleep": _sleep_rows(args)}
    if not args.no_mlp:
        result["mlp"] = _mlp_rows(args)
    return result


def _print(world: int, args: argparse.Namespace, result: dict[str, Any]) -> None:
    print(f"\np = {world} gloo processes x 1 thread, m = {args.microbatches}, {2 * world} "
          f"sleep blocks ({args.sleep_ms:g} ms each in F, I and W), min of {args.retries}")
    print("bubble by sleeps: 1 - sleeping / (ranks x step), smp-fx and torch alike, beside the"
          " simulator priced by the sleeps (sim0);\nby actions: smp-fx's action ops' durations"
          " instead, beside the simulator priced by those durations (sim)")
    print(f"{'smp-fx schedule':<17} {'torch':<30} {'smp-fx s':>9} {'torch s':>8} "
          f"{'ratio':>6} {'sleeps':>7} {'torch':>6} {'sim0':>6} {'|d|':>6} {'actions':>8} "
          f"{'sim':>6} {'|d|':>6}")
    rows: list[Row] = result["sleep"]
    for r in rows:
        print(f"{r.pipeline + f' v={r.v}':<17} {r.torch_name:<30} {r.smp_s:>9.3f} "
              f"{r.torch_s:>8.3f} {r.smp_s / r.torch_s:>6.3f} {r.smp_bubble:>7.3f} "
              f"{r.torch_bubble:>6.3f} {r.sleep_sim_bubble:>6.3f} "
              f"{abs(r.smp_bubble - r.sleep_sim_bubble):>6.3f} {r.action_bubble:>8.3f} "
              f"{r.sim_bubble:>6.3f} {abs(r.action_bubble - r.sim_bubble):>6.3f}")
    by = {(r.pipeline, r.v): r for r in rows}
    if ("zbv", 2) in by and ("interleaved", 1) in by:
        zbv, one = by[("zbv", 2)], by[("interleaved", 1)]
        print(f"ZB-V / 1F1B step: {zbv.smp_s / one.smp_s:.3f} (smp-fx), "
              f"{zbv.torch_s / one.torch_s:.3f} (torch)")
    if "mlp" in result:
        print(f"\nreal-compute MLP (pipeline_vs_torch.py: width 512, depth 8, batch "
              f"{args.mlp_batch}, {MLP_MICROBATCHES} microbatches), p = {world}, min of "
              f"{args.retries * 3} alternated; ratio of the fastest, median of paired ratios")
        for pipeline, v, torch_name, smp_s, torch_s, paired in result["mlp"]:
            print(f"{pipeline + f' v={v}':<17} {torch_name:<30} {smp_s * 1e3:>8.2f} ms "
                  f"{torch_s * 1e3:>8.2f} ms {smp_s / torch_s:>6.3f} {paired:>6.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--sleep-ms", type=float, default=50.0)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mlp-batch", type=int, default=128)
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--no-mlp", action="store_true", help="skip the real-compute MLP")
    ap.add_argument("--schedules", nargs="+", metavar="NAME:V",
                    help="only these sleep rows, e.g. zero_bubble:2 interleaved:1")
    args = ap.parse_args()
    for world in args.ranks:
        _print(world, args, spawn_ranks(world, _schedules, args, timeout=3600))


if __name__ == "__main__":
    main()
