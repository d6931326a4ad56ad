"""Orders are topological (and honour pins); refinement never makes a plan worse."""

from __future__ import annotations

import numpy as np
import pytest

from cost_model.errors import SMPPartitionError
from passes.partition_config import PartitionConfig
from passes.partitioning import chain
from passes.partitioning.order import ORDERS, PIN_ORDER, check_pins, topological_order
from passes.partitioning.problem import DagProblem, chain_arrays, evaluate, make_objective
from passes.partitioning.refine import _State, refine
from passes.partitioning.synthetic import random_dag, transformer_dag


def is_topological(problem: DagProblem, order: np.ndarray) -> bool:
    pos = np.empty(problem.n, dtype=np.int64)
    pos[order] = np.arange(problem.n)
    return sorted(order.tolist()) == list(range(problem.n)) and all(
        pos[p] < pos[v] for v, ps in enumerate(problem.preds) for p in ps)


def test_orders_are_topological_and_deterministic() -> None:
    for seed in range(3):
        problem = random_dag(150, np.random.default_rng(seed), width=5)
        for kind in ORDERS:
            order = topological_order(problem, kind)
            assert is_topological(problem, order), kind
            assert np.array_equal(order, topological_order(problem, kind))


def _with_preds(preds: tuple[tuple[int, ...], ...], **fields: object) -> DagProblem:
    base = DagProblem.chain(time=[1.0] * len(preds))
    return DagProblem(**{**base.__dict__, "preds": preds, **fields})


def test_dfs_finishes_a_branch_before_its_sibling() -> None:
    # 0 feeds two branches 1-2 and 3-4 that join at 5; 6 reads 0 directly
    problem = _with_preds(((), (0,), (1,), (0,), (3,), (2, 4), (0, 5)))
    assert topological_order(problem, "dfs").tolist() == [0, 1, 2, 3, 4, 5, 6]
    # graph order interleaves the branches; dfs still runs each to its end
    problem = _with_preds(((), (0,), (0,), (1,), (2,), (3, 4)))
    assert topological_order(problem, "dfs").tolist() == [0, 1, 3, 2, 4, 5]
    # two sources: the later one's branch comes first, then the earlier one's, then the join
    problem = _with_preds(((), (0,), (), (2,), (1, 3)))
    assert topological_order(problem, "dfs").tolist() == [2, 3, 0, 1, 4]


def test_a_cycle_or_an_order_out_of_order_is_named() -> None:
    with pytest.raises(SMPPartitionError, match="cycle.*n0 -> n1 -> n2 -> n0"):
        topological_order(_with_preds(((2,), (0,), (1,))), "dfs")
    with pytest.raises(SMPPartitionError, match="topological order.*n2 -> n1"):
        topological_order(_with_preds(((), (2,), ())), "graph")


def test_pins_against_the_data_flow_name_the_path() -> None:
    # 1 (pinned to 1) feeds 2 feeds 3 (pinned to 0): no contiguous plan
    problem = _with_preds(((), (0,), (1,), (2,)), pins=(-1, 1, -1, 0))
    with pytest.raises(SMPPartitionError, match=r"n1 -> n2 -> n3 \(pinned to 1 and 0\)"):
        check_pins(problem)
    check_pins(_with_preds(((), (0,), (1,), (2,)), pins=(-1, 0, -1, 1)))


def test_pin_order_puts_pinned_branches_first() -> None:
    # two independent chains 0-1-2 and 3-4-5 joined by 6; pin 3 to stage 0, 2 to stage 1
    preds = ((), (0,), (1,), (), (3,), (4,), (2, 5))
    base = DagProblem.chain(time=[1.0] * 7)
    problem = DagProblem(**{**base.__dict__, "preds": preds,
                            "pins": (-1, -1, 1, 0, -1, -1, -1)})
    order = topological_order(problem, PIN_ORDER)
    assert is_topological(problem, order)
    pos = {v: i for i, v in enumerate(order.tolist())}
    assert pos[3] < pos[2]


def test_refine_keeps_plans_valid_and_never_worse() -> None:
    for seed, problem in enumerate([transformer_dag(4), random_dag(300, np.random.default_rng(9)),
                                    random_dag(300, np.random.default_rng(10), width=8)]):
        for k in (2, 5, 9):
            obj = make_objective(problem, PartitionConfig(num_stages=k, microbatches=4))
            order = topological_order(problem, ORDERS[seed % 3])
            cc = chain_arrays(problem, order, obj)
            sol = chain.solve(cc.work, k, saved=cc.saved, comm=cc.comm, time=cc.time,
                              inflight=np.asarray(obj.inflight, dtype=float))
            st = np.empty(problem.n, dtype=np.int64)
            st[order] = sol.stages(problem.n)
            before = evaluate(problem, st, obj).bottleneck
            out = refine(problem, obj, st)
            assert set(out.tolist()) == set(range(k))
            assert all(out[p] <= out[v] for v, ps in enumerate(problem.preds) for p in ps)
            assert evaluate(problem, out, obj).bottleneck <= before * (1 + 1e-12)


def test_incremental_costs_match_a_full_evaluation() -> None:
    rng = np.random.default_rng(4)
    problem = random_dag(120, rng, width=4)
    k = 4
    obj = make_objective(problem, PartitionConfig(num_stages=k, microbatches=4))
    order = topological_order(problem, "dfs")
    cc = chain_arrays(problem, order, obj)
    st = np.empty(problem.n, dtype=np.int64)
    st[order] = chain.solve(cc.work, k, saved=cc.saved, comm=cc.comm, time=cc.time,
                            inflight=np.asarray(obj.inflight, dtype=float)).stages(problem.n)
    state = _State(problem, obj, st)
    moves = 0
    for _ in range(400):
        v = int(rng.integers(0, problem.n))
        t = state.st[v] + int(rng.choice([-1, 1]))
        if 0 <= t < k and state.movable(v, t):
            state.apply(v, t)
            moves += 1
    assert moves > 20
    np.testing.assert_allclose(state.cost, evaluate(problem, state.stage(), obj).cost, rtol=1e-9)
