"""Per-step CPU time and event counts, smp-fx's schedules beside torch's, per rank.

Wall-clock ratios on a shared machine measure the neighbours; what a schedule's executor
does per step does not move with them. On the real-compute MLP of
``benchmarks/schedules_vs_torch.py`` (same stage split, same placement), each rank prints,
for smp-fx and for its ``torch.distributed.pipelining`` counterpart, the median over
``--steps`` alternated steps of its CPU time split by thread and by what ran (``USAGE``:
"rest py", the Python threads' time outside the stage modules and autograd, is the
schedule's own work) and its context switches; then, in one more step each on models
built anew, Python calls and C calls made by Python (every thread) and aten ops
(torch.profiler, every thread). ``--detail N`` lists the N functions and ops whose
counts differ most.

    python benchmarks/step_counts.py                       # 1F1B at p = 2 and 4
    python benchmarks/step_counts.py --ranks 2 --schedules simple:1 zbv:2 --detail 15
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.schedules_vs_torch import (  # noqa: E402
    MLP_MICROBATCHES,
    PAIRS,
    _smp_model,
    _torch_schedule,
    _torch_step,
    spawn_ranks,
)

Counts = collections.Counter[str]
USAGE = ("CPU ms", "thread ms", "other py ms", "native ms", "fwd ms", "bwd ms", "rest py ms",
         "vol sw", "invol sw")
"""Per step: the process's CPU (every thread), the calling thread's, the other Python
threads' (step functions), the native threads' (gloo's); inside the stage modules'
forwards and autograd's backward (every thread); the Python threads' rest, the schedule's
own work; voluntary and involuntary context switches."""


class _Calls:
    """Python-level calls, counted on every thread while ``on`` (installed before the
    threads it must see start, see ``_rows``)."""

    def __init__(self) -> None:
        self.on = False
        self.counts: Counts = collections.Counter()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on:
            return
        if event == "call":
            code = frame.f_code
            self.counts[f"py {Path(code.co_filename).name}:{code.co_name}"] += 1
        elif event == "c_call":
            self.counts[f"c {getattr(arg, '__qualname__', repr(arg))}"] += 1


class _Clock:
    """Thread CPU inside the stage modules' forwards (hooks on smp-fx's chunk modules,
    which torch's stages run too) and inside autograd's backward and grad (wrapped), summed
    over threads: the rest of the Python threads' CPU is the schedule's own."""

    def __init__(self) -> None:
        self.spent = {"forward": 0.0, "backward": 0.0}
        self._local = threading.local()

    def hook(self, modules: list[torch.nn.Module]) -> None:
        def pre(*_: Any) -> None:
            self._local.start = time.thread_time()

        def post(*_: Any) -> None:
            self.spent["forward"] += time.thread_time() - self._local.start

        for mod in modules:
            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)

    def wrap_autograd(self) -> None:
        for name in ("backward", "grad"):
            setattr(torch.autograd, name, self._timed(getattr(torch.autograd, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):  # nested (a W's joins)
                return fn(*args, **kwargs)
            self._local.inside = True
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent["backward"] += time.thread_time() - start
                self._local.inside = False

        return timed


CLOCK = _Clock()


def _usage() -> dict[str, float]:
    """The running totals behind ``USAGE`` (ms and counts)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    others = 0.0
    for t in threading.enumerate():
        if t is not threading.current_thread() and t.ident is not None:
            with contextlib.suppress(OSError):  # a thread that just ended
                others += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    cpu, mine = r.ru_utime + r.ru_stime, time.thread_time()
    fwd, bwd = CLOCK.spent["forward"], CLOCK.spent["backward"]
    ms = (cpu, mine, others, cpu - mine - others, fwd, bwd, mine + others - fwd - bwd)
    return dict(zip(USAGE, (*(x * 1e3 for x in ms), r.ru_nvcsw, r.ru_nivcsw)))


def _measured(step: Callable[[], Any]) -> dict[str, float]:
    """One step between barriers: ``USAGE``'s figures spent in it."""
    dist.barrier()
    a = _usage()
    step()
    b = _usage()
    dist.barrier()
    return {k: b[k] - a[k] for k in USAGE}


def _aten(step: Callable[[], Any]) -> Counts:
    """aten ops of one step on every thread (torch.profiler), ``all`` and ``top`` totals."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU],
                 experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        step()
    dist.barrier()
    counts: Counts = collections.Counter()
    for e in prof.events():
        if e.name.startswith("aten::"):
            counts["op " + e.name] += 1
            counts["ops: all"] += 1
            if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"):
                counts["ops: top-level"] += 1
        elif e.name.startswith("autograd::engine::evaluate_function"):
            counts["autograd nodes"] += 1
    return counts


def _build(pipeline: str, v: int, torch_name: str, x: torch.Tensor, y: torch.Tensor
           ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    from benchmarks.pipeline_vs_torch import build_model

    torch.manual_seed(0)
    dm, train_step = _smp_model(MLP_MICROBATCHES, pipeline, v, build_model(512, 8),
                                active=MLP_MICROBATCHES)
    train_step(dm, x, y)  # partitions
    rank_of = tuple(dm.plan.rank_of)
    CLOCK.hook([dm.program.stages[c].module for c, r in enumerate(rank_of)
                if r == dist.get_rank()])
    sched = _torch_schedule(torch_name, dm.program, rank_of, MLP_MICROBATCHES)
    return functools.partial(train_step, dm, x, y), _torch_step(sched, rank_of, x, y)


def _counted(step: Callable[[], Any], calls: _Calls) -> Counts:
    """Python and C calls and aten ops of one step (every thread)."""
    dist.barrier()
    calls.counts = collections.Counter()
    calls.on = True
    sys.setprofile(calls)
    step()
    sys.setprofile(None)
    calls.on = False
    dist.barrier()
    c = calls.counts
    c["calls: python"] = sum(n for k, n in c.items() if k.startswith("py "))
    c["calls: C"] = sum(n for k, n in c.items() if k.startswith("c "))
    return c + _aten(step)


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    CLOCK.wrap_autograd()
    torch.manual_seed(1)
    x = torch.randn(args.mlp_batch, 512)
    y = torch.randint(0, 10, (args.mlp_batch,))
    rows = []
    for pipeline, v, torch_name in PAIRS:
        if f"{pipeline}:{v}" not in args.schedules:
            continue
        sides = dict(zip(("smp", "torch"), _build(pipeline, v, torch_name, x, y)))
        for _ in range(2):
            for step in sides.values():
                step()
        usage: dict[str, list[dict[str, float]]] = {"smp": [], "torch": []}
        for _ in range(args.steps):
            for side, step in sides.items():
                usage[side].append(_measured(step))
        # counted on a model built anew: the profile function must be there before the
        # step functions' threads start, and must not be there while CPU is timed
        calls = _Calls()
        threading.setprofile(calls)
        counted = dict(zip(("smp", "torch"), _build(pipeline, v, torch_name, x, y)))
        for step in counted.values():
            step()
        counts = {side: _counted(step, calls) for side, step in counted.items()}
        threading.setprofile(None)
        med = {side: {k: statistics.median(u[k] for u in us) for k in USAGE}
               for side, us in usage.items()}
        rows.append({"schedule": f"{pipeline} v={v}", "torch": torch_name, "usage": med,
                     "counts": counts})
    return rows


def _everyones_rows(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _rows(args))
    return everyone


TOTALS = ("calls: python", "calls: C", "ops: top-level", "ops: all", "autograd nodes")


def _print(world: int, args: argparse.Namespace, ranks: list[list[dict[str, Any]]]) -> None:
    print(f"\np = {world}: MLP 512 x 8, batch {args.mlp_batch}, {MLP_MICROBATCHES} "
          f"microbatches; first block: median of {args.steps} alternated steps; second: "
          "one step; each cell smp-fx / torch")
    for keys, fmt in ((USAGE, "{:.2f}"), (TOTALS, "{:.0f}")):  # the switches: medians
        print(f"{'schedule':<16} {'rank':>4} " + " ".join(f"{k:>15}" for k in keys))
        for i, row in enumerate(ranks[0]):
            for r, rows in enumerate(ranks):
                got = rows[i]["usage" if keys is USAGE else "counts"]
                cells = [f"{fmt.format(got['smp'][k])}/{fmt.format(got['torch'][k])}"
                         for k in keys]
                print(f"{row['schedule']:<16} {r:>4} " + " ".join(f"{c:>15}" for c in cells))
    if not args.detail:
        return
    for i, row in enumerate(ranks[0]):
        for r, rows in enumerate(ranks):
            c = rows[i]["counts"]
            seen = set(c["smp"]) | set(c["torch"])
            for kind in ("op ", "py ", "c "):
                diff = sorted((k for k in seen if k.startswith(kind)),
                              key=lambda k: -abs(c["smp"][k] - c["torch"][k]))
                print(f"{row['schedule']}, rank {r}, most different '{kind.strip()}' counts "
                      "(smp-fx / torch):")
                for k in diff[:args.detail]:
                    print(f"    {c['smp'][k]:>5} / {c['torch'][k]:<5} {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", metavar="NAME:V", default=["interleaved:1"],
                    help="smp-fx pipeline:virtual degree pairs of schedules_vs_torch.PAIRS")
    ap.add_argument("--mlp-batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--detail", type=int, default=0, metavar="N")
    args = ap.parse_args()
    for world in args.ranks:
        _print(world, args, spawn_ranks(world, _everyones_rows, args, timeout=1800))


if __name__ == "__main__":
    main()
