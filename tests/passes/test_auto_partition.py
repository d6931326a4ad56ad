"""auto_partition on small traced models: validity, objective behaviour, pins, ties, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch.fx

from cost_model.devices import A100
from cost_model.errors import SMPPartitionError
from cost_model.roofline import link_model
from passes import meta
from passes.auto_partition import (
    PartitionResult,
    evaluate_stages,
    partition_graph,
    solve_problem,
)
from passes.partition_config import PartitionConfig
from passes.partitioning.extract import COMPUTE_OPS, problem_from_graph
from passes.partitioning.problem import DagProblem, evaluate, make_objective
from tests.passes.partitioning.graphs import tiny_gpt, two_branch

FAST_LINK = link_model(dataclasses.replace(A100, link_bandwidth=1e15, link_latency_s=0.0))


def stages_of(gm: torch.fx.GraphModule) -> dict[str, int]:
    return {n.name: meta.STAGE.get(n) for n in gm.graph.nodes}


def assert_valid(gm: torch.fx.GraphModule, k: int) -> None:
    st = stages_of(gm)
    assert all(v is not None and 0 <= v < k for v in st.values())
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    assert {meta.STAGE.get(n) for n in compute} == set(range(k)), "every stage non-empty"
    for n in compute:
        for a in n.all_input_nodes:
            if a.op in COMPUTE_OPS:
                assert meta.STAGE.get(a) <= meta.STAGE.get(n), (a.name, n.name)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_valid_plan_and_input_untouched(k: int) -> None:
    gm = tiny_gpt()
    before = [dict(n.meta) for n in gm.graph.nodes]
    new, result = partition_graph(gm, PartitionConfig(num_stages=k, microbatches=4))
    assert new is not gm
    assert [dict(n.meta) for n in gm.graph.nodes] == before
    assert_valid(new, k)
    assert result.objective == pytest.approx(max(s.cost for s in result.stages))
    assert result.lower_bound <= result.objective * (1 + 1e-9)
    assert PartitionResult.from_json(result.to_json()) == result
    again = evaluate_stages(new, PartitionConfig(num_stages=k, microbatches=4))
    assert again.objective == pytest.approx(result.objective)


def test_dag_branches_stay_contiguous() -> None:
    new, _ = partition_graph(two_branch(), PartitionConfig(num_stages=3))
    assert_valid(new, 3)


def test_memory_weight_zero_balances_time_one_balances_memory() -> None:
    # time is front-loaded, parameters are back-loaded: the two objectives disagree
    n = 12
    time = np.linspace(3.0, 0.1, n)
    params = np.linspace(0.1, 3.0, n) * 1e6
    problem = DagProblem.chain(time, params=params)
    spread = {}
    for w in (0.0, 1.0):
        obj = make_objective(problem, PartitionConfig(num_stages=3, memory_weight=w),
                             *FAST_LINK)
        st, _ = solve_problem(problem, obj)
        ev = evaluate(problem, st, obj)
        spread[w] = (ev.time_s.max() / ev.time_s.sum(), ev.param_bytes.max() / params.sum())
    assert spread[0.0][0] < spread[1.0][0]  # time more balanced with w = 0
    assert spread[1.0][1] < spread[0.0][1]  # memory more balanced with w = 1


def test_inflight_per_schedule() -> None:
    simple = PartitionConfig(num_stages=4, microbatches=8, pipeline="simple")
    inter = PartitionConfig(num_stages=4, microbatches=8, pipeline="interleaved")
    capped = PartitionConfig(num_stages=4, microbatches=8, pipeline="simple",
                             active_microbatches=3)
    assert [simple.inflight(s) for s in range(4)] == [6, 6, 6, 6]  # active default p + 2
    assert [inter.inflight(s) for s in range(4)] == [4, 3, 2, 1]
    assert [capped.inflight(s) for s in range(4)] == [3, 3, 3, 3]
    few = PartitionConfig(num_stages=4, microbatches=2, pipeline="interleaved")
    assert [few.inflight(s) for s in range(4)] == [2, 2, 2, 1]
    _, result = partition_graph(tiny_gpt(), inter)
    assert [s.inflight for s in result.stages] == [4, 3, 2, 1]
    assert PartitionConfig.from_json(inter.to_json()) == inter


def test_pins_are_respected() -> None:
    gm = tiny_gpt()
    pinned = {"blocks_1_fc1": 2, "relu": 0}
    for n in gm.graph.nodes:
        if n.name in pinned:
            meta.PIN.set(n, pinned[n.name])
    new, _ = partition_graph(gm, PartitionConfig(num_stages=4))
    assert_valid(new, 4)
    st = stages_of(new)
    assert all(st[name] == s for name, s in pinned.items())


def test_pins_that_the_graph_order_cannot_honour() -> None:
    # graph order runs branch a before branch b; b_0 pinned to 0 and a_2 to 1 needs b first
    gm = two_branch()
    pinned = {"b_0": 0, "a_2": 1, "head": 1}
    for n in gm.graph.nodes:
        if n.name in pinned:
            meta.PIN.set(n, pinned[n.name])
    new, result = partition_graph(gm, PartitionConfig(num_stages=2))
    assert_valid(new, 2)
    st = stages_of(new)
    assert all(st[name] == s for name, s in pinned.items())
    bad = {"b_0": 1, "b_1": 0}  # b_1 reads b_0: no contiguous plan exists
    gm = two_branch()
    for n in gm.graph.nodes:
        if n.name in bad:
            meta.PIN.set(n, bad[n.name])
    with pytest.raises(SMPPartitionError, match="pinned"):
        partition_graph(gm, PartitionConfig(num_stages=2))


def test_deterministic() -> None:
    cfg = PartitionConfig(num_stages=3, microbatches=4)
    a = partition_graph(tiny_gpt(), cfg)
    b = partition_graph(tiny_gpt(), cfg)
    assert stages_of(a[0]) == stages_of(b[0])
    assert a[1].to_json() == b[1].to_json()


def test_tied_embedding_is_reported_and_charged_twice() -> None:
    new, result = partition_graph(tiny_gpt(), PartitionConfig(num_stages=2))
    assert result.shared_params == {"emb.weight": (0, 1)}
    emb_bytes = 32 * 16 * 4
    assert all(s.param_bytes >= emb_bytes for s in result.stages)
    st = stages_of(new)
    assert st["emb"] == 0 and st["linear"] == 1 and st["emb_weight"] == 1


def test_too_many_partitions() -> None:
    gm = two_branch()
    with pytest.raises(SMPPartitionError, match="partitions=9, compute nodes=8"):
        partition_graph(gm, PartitionConfig(num_stages=9))


def test_missing_costs_name_the_node() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(SMPPartitionError, match="annotate_costs"):
        partition_graph(gm, PartitionConfig(num_stages=1))


def test_link_latency_does_not_make_a_tiny_model_degenerate() -> None:
    # a link latency far above the whole model's compute, charged to every sending stage,
    # would put ~3/4 of the compute on the last stage (the one that sends nothing). Sends
    # overlap compute and latency is not link occupancy: the plan is the same as with no
    # latency at all, and the compute is spread over the stages.
    for w in (0.0, 0.8):
        plans = []
        for latency in (0.0, 1e-2):
            cfg = PartitionConfig(num_stages=4, microbatches=4, memory_weight=w)
            spec = dataclasses.replace(A100, link_bandwidth=25e9, link_latency_s=latency)
            new, result = partition_graph(tiny_gpt(), cfg, link_model(spec)[0])
            assert_valid(new, 4)
            time = np.array([s.time_s for s in result.stages])
            assert time.max() < 0.4 * time.sum(), time / time.sum()
            assert all(s.comm_time_s == pytest.approx(s.link_time_s + latency)
                       for s in result.stages[:-1])
            plans.append(stages_of(new))
        assert plans[0] == plans[1]


def test_slow_link_plan_still_puts_real_work_on_every_stage() -> None:
    # a link so slow that every send dwarfs the model's compute: every sending stage is
    # link-bound whatever it computes, and plain min-max could leave stages 0..k-2 with
    # glue only (getattr, view)
    gm = tiny_gpt()
    cfg = PartitionConfig(num_stages=4, microbatches=4)
    new, result = partition_graph(gm, cfg, link_model(dataclasses.replace(
        A100, link_bandwidth=1e3))[0])
    assert_valid(new, 4)
    problem = problem_from_graph(new)
    heavy = problem.heavy()
    stage = np.asarray([meta.STAGE.get(n) for n in new.graph.nodes if n.op in COMPUTE_OPS])
    assert all(heavy[stage == s].any() for s in range(4)), stage
    assert all(s.link_time_s > s.time_s for s in result.stages[:-1])


def test_balance_never_worsens_the_sorted_stage_costs() -> None:
    # a huge node fixes the bottleneck; the other stages are balanced, not left lopsided
    problem = DagProblem.chain([20.0] + [1.0] * 12)
    obj = make_objective(problem, PartitionConfig(num_stages=4), *FAST_LINK)
    st, _ = solve_problem(problem, obj)
    plain, _ = solve_problem(problem, obj, do_refine=False)
    costs = evaluate(problem, st, obj).cost
    assert costs.max() == pytest.approx(evaluate(problem, plain, obj).cost.max())
    assert np.bincount(st).tolist() == [1, 4, 4, 4]
    assert sorted(costs)[:3] == pytest.approx([sorted(costs)[0]] * 3)
