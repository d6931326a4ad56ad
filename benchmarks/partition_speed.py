"""Partitioner speed: a 10,000-node chain into 64 stages (< 0.1 s) and a 10,000-node DAG
(< 1 s). Prints medians over repeated runs on one core.

* ``chain.solve`` alone: the exact parametric search on prepared cost arrays.
* ``chain, full``: ``solve_problem`` on a chain ``DagProblem`` with the graph order only
  (cost layout + solve + refinement), what ``auto_partition`` does per order.
* ``DAG``: ``solve_problem`` with all three orders, chain solves and refinement; networkx
  builds the problem's graph and the ``"dfs"`` order.
* ``DAG, link-bound``: the same at 0.1 GB/s, where refinement also runs networkx minimum
  cuts on link-bound stages (``partitioning.mincut``).
* ``networkx graph``: building ``DagProblem.graph`` alone, part of the DAG rows.

Every ``solve_problem`` run gets a fresh copy of the problem, so the per-problem caches
(the networkx graph among them) are built inside the timing, as in ``auto_partition``.

Both the wall-clock and the CPU-time (``time.process_time``) medians are printed, with the
load average: on a shared machine wall time grows with the load, CPU time does not, so the
targets are checked on CPU time (single-threaded code: the two agree on an idle machine).

Run: ``.venv/bin/python benchmarks/partition_speed.py``
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from passes.auto_partition import solve_problem
from passes.partition_config import PartitionConfig
from passes.partitioning import chain
from passes.partitioning.problem import DagProblem, Objective, chain_arrays, make_objective
from passes.partitioning.synthetic import random_chain, random_dag


def median_time(repeat: int, fn: Callable[..., object], *args: object, **kwargs: object
                ) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds) over ``repeat`` runs."""
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(*args, **kwargs)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def solve_fresh(problem: DagProblem, obj: Objective, **kwargs: object) -> object:
    """``solve_problem`` on a copy without the per-problem caches (graph, adjacency)."""
    return solve_problem(dataclasses.replace(problem), obj, **kwargs)


def main() -> int:
    rng = np.random.default_rng(0)
    ok = True
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'case':38s} {'n':>6s} {'k':>3s} {'wall s':>8s} {'cpu s':>8s} {'target':>7s}")
    for kind in ("uniform", "heavy_tailed", "embedding_blocks_head"):
        problem = random_chain(10_000, kind, rng)
        obj = make_objective(problem, PartitionConfig(num_stages=64, microbatches=8))
        cc = chain_arrays(problem, np.arange(problem.n), obj)
        infl = np.asarray(obj.inflight, dtype=float)
        w, c = median_time(7, chain.solve, cc.work, 64, time=cc.time, saved=cc.saved,
                           comm=cc.comm, inflight=infl)
        ok &= c < 0.1
        print(f"{'chain.solve ' + kind:38s} {problem.n:6d} {64:3d} {w:8.4f} {c:8.4f} {'0.1':>7s}")
        w, c = median_time(3, solve_fresh, problem, obj, orders=("graph",))
        print(f"{'chain, full ' + kind:38s} {problem.n:6d} {64:3d} {w:8.4f} {c:8.4f} {'-':>7s}")
    for k in (8, 64):
        problem = random_dag(10_000, rng, width=4)
        obj = make_objective(problem, PartitionConfig(num_stages=k, microbatches=8))
        w, c = median_time(3, solve_fresh, problem, obj)
        ok &= c < 1.0
        print(f"{'DAG (3 orders, refine, re-solve)':38s} {problem.n:6d} {k:3d} {w:8.4f} {c:8.4f}"
              f" {'1.0':>7s}")
    w, c = median_time(3, lambda p: dataclasses.replace(p).graph, problem)
    print(f"{'networkx graph (DagProblem.graph)':38s} {problem.n:6d} {'-':>3s} {w:8.4f} {c:8.4f}"
          f" {'-':>7s}")
    problem = random_dag(10_000, rng, width=4)
    obj = make_objective(problem, PartitionConfig(num_stages=16, microbatches=8),
                         comm_time=lambda nbytes: nbytes / 1e8)
    w, c = median_time(3, solve_fresh, problem, obj)
    print(f"{'DAG, link-bound (min-cut moves)':38s} {problem.n:6d} {16:3d} {w:8.4f} {c:8.4f}"
          f" {'-':>7s}")
    print("all targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
