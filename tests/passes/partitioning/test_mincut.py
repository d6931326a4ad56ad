"""The minimum-cut boundary move: exact on the boundary's bytes, and it frees refine when
only a group move lowers a link-bound stage."""

from __future__ import annotations

import itertools

import numpy as np

from passes.partition_config import PartitionConfig
from passes.partitioning import chain
from passes.partitioning.mincut import min_cut_assignment
from passes.partitioning.order import topological_order
from passes.partitioning.problem import DagProblem, chain_arrays, evaluate, make_objective
from passes.partitioning.refine import refine
from passes.partitioning.synthetic import random_dag


def fan_out() -> DagProblem:
    """a -> x; x (1 MB) read by y1 and y2 (1 kB each); z reads both; w reads z."""
    names = ("a", "x", "y1", "y2", "z", "w")
    preds = ((), (0,), (1,), (1,), (2, 3), (4,))
    out = np.array([1e6, 1e6, 1e3, 1e3, 1e3])
    return DagProblem(
        names=names, time=np.ones(6), saved=np.zeros(6), preds=preds,
        val_producer=(0, 1, 2, 3, 4), val_bytes=out,
        val_consumers=((1,), (2, 3), (4,), (4,), (5,)), val_to_output=(False,) * 5,
        output_inputs=(5,), module_paths=("",) * 6, flops=np.ones(6))


def test_refine_moves_a_group_across_a_link_bound_boundary() -> None:
    problem = fan_out()
    # 100 kB/s: x's 1 MB takes 10 s on the link against 2 s of compute on stage 0
    obj = make_objective(problem, PartitionConfig(num_stages=2, memory_weight=0.0),
                         comm_time=lambda nbytes: nbytes / 1e5)
    start = np.array([0, 0, 1, 1, 1, 1])
    assert evaluate(problem, start, obj).link_time_s[0] == 10.0
    # no single move helps: y1 or y2 alone leaves x crossing, and adds its own output
    for v in (2, 3):
        alone = start.copy()
        alone[v] = 0
        assert evaluate(problem, alone, obj).bottleneck > evaluate(problem, start, obj).bottleneck
    out = refine(problem, obj, start)
    assert out.tolist() == [0, 0, 0, 0, 1, 1]
    ev = evaluate(problem, out, obj)
    assert ev.comm_bytes[0] == 2e3 and ev.time_s.tolist() == [4.0, 2.0]


def convex_splits(problem: DagProblem, stage: np.ndarray, s: int, free: list[int]
                  ) -> list[np.ndarray]:
    """Every assignment of ``free`` to stages s / s + 1 that keeps every edge forward."""
    src, dst = np.array([(p, v) for v, ps in enumerate(problem.preds) for p in ps]).T
    out = []
    for bits in itertools.product((s, s + 1), repeat=len(free)):
        st = stage.copy()
        st[free] = bits
        if np.all(st[src] <= st[dst]):
            out.append(st)
    return out


def test_the_cut_has_the_fewest_boundary_bytes_of_any_convex_split() -> None:
    rng = np.random.default_rng(5)
    for seed in range(20):
        problem = random_dag(40, np.random.default_rng(seed), width=4)
        problem = DagProblem(**{**problem.__dict__,
                                "val_bytes": np.round(problem.val_bytes)})  # whole bytes
        k = 4
        obj = make_objective(problem, PartitionConfig(num_stages=k))
        order = topological_order(problem, "graph")
        cc = chain_arrays(problem, order, obj)
        st = chain.solve(cc.work, k, saved=cc.saved, comm=cc.comm, time=cc.time).stages(
            problem.n)
        s = int(rng.integers(0, k - 1))
        pool = np.flatnonzero((st == s) | (st == s + 1))
        free = sorted(int(v) for v in rng.choice(pool, size=min(len(pool), 9), replace=False))
        cut = min_cut_assignment(problem, st, s, free)
        assert all(cut[p] <= cut[v] for v, ps in enumerate(problem.preds) for p in ps)
        assert set(np.flatnonzero(cut != st).tolist()) <= set(free)
        best = min(evaluate(problem, c, obj).comm_bytes[s]
                   for c in convex_splits(problem, st, s, free))
        assert evaluate(problem, cut, obj).comm_bytes[s] == best
