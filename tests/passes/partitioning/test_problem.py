"""The shared objective, checked against the formula by hand on a 3-node chain."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cost_model.devices import A100
from cost_model.roofline import link_model
from passes.partition_config import PartitionConfig
from passes.partitioning.problem import (
    DagProblem,
    chain_arrays,
    evaluate,
    link_occupancy,
    make_objective,
)


def test_objective_by_hand() -> None:
    p = DagProblem.chain(time=[1.0, 2.0, 3.0], saved=[10.0, 20.0, 30.0],
                         out_bytes=[100.0, 200.0, 300.0], params=[1000.0, 0.0, 500.0])
    cfg = PartitionConfig(num_stages=2, memory_weight=0.25, microbatches=3,
                          pipeline="interleaved", optimizer_state_factor=2.0)
    spec = dataclasses.replace(A100, link_bandwidth=100.0, link_latency_s=0.5)
    obj = make_objective(p, cfg, *link_model(spec))
    assert obj.time_total == 6.0
    assert obj.memory_total == 4 * 1500.0 + 60.0 * 3  # params x (1 + 1 + 2), saved x m
    assert obj.inflight == (2, 1)  # min(p - s, m)
    ev = evaluate(p, np.array([0, 0, 1]), obj)
    assert ev.comm_bytes.tolist() == [200.0, 0.0]  # node 1's output crosses the boundary
    # stage time = max(compute, link occupancy); the latency is reported, never charged
    assert ev.comm_time_s.tolist() == pytest.approx([0.5 + 2.0, 0.0])
    assert ev.link_time_s.tolist() == pytest.approx([2.0, 0.0])
    t0 = max(3.0, 200.0 / 100.0) / 6.0
    m0 = (4 * 1000.0 + 30.0 * 2) / obj.memory_total
    t1 = 3.0 / 6.0
    m1 = (4 * 500.0 + 30.0 * 1) / obj.memory_total
    assert ev.cost.tolist() == pytest.approx([0.75 * t0 + 0.25 * m0, 0.75 * t1 + 0.25 * m1])
    cc = chain_arrays(p, np.arange(3), obj)
    assert cc.comm.tolist() == pytest.approx([0.0, 0.75 * 1.0 / 6.0, 0.75 * 2.0 / 6.0, 0.0])
    assert cc.time.tolist() == pytest.approx([0.75 * t / 6.0 for t in (1.0, 2.0, 3.0)])
    # a slower link: the send now outlasts the stage's compute and sets its time
    slow = make_objective(p, cfg, *link_model(dataclasses.replace(spec, link_bandwidth=40.0)))
    ev = evaluate(p, np.array([0, 0, 1]), slow)
    assert ev.cost[0] == pytest.approx(0.75 * 5.0 / 6.0 + 0.25 * m0)


def test_link_occupancy_of_a_transfer_model_drops_the_latency() -> None:
    cfg = PartitionConfig(num_stages=2)
    comm, link = link_model(dataclasses.replace(A100, link_bandwidth=1e9, link_latency_s=5e-6))
    occ = link_occupancy(comm)
    for nbytes in (0.0, 1.0, 4096.0, 1e9):
        assert occ(nbytes) == pytest.approx(link(nbytes), rel=1e-6, abs=1e-15)
    p = DagProblem.chain(time=[1.0, 1.0])
    assert make_objective(p, cfg, comm_time=comm).link_time(1e6) == pytest.approx(1e-3)


def test_shared_parameter_is_charged_to_every_owner() -> None:
    base = DagProblem.chain(time=[1.0, 1.0, 1.0])
    tied = DagProblem(**{**base.__dict__, "param_names": ("w",),
                         "param_bytes": np.array([64.0]), "param_readers": ((0, 2),)})
    obj = make_objective(tied, PartitionConfig(num_stages=3, memory_weight=1.0))
    ev = evaluate(tied, np.array([0, 1, 2]), obj)
    assert ev.param_bytes.tolist() == [64.0, 0.0, 64.0]
    assert ev.shared_params == {"w": (0, 2)}
    assert evaluate(tied, np.array([0, 0, 0]), make_objective(
        tied, PartitionConfig(num_stages=1))).shared_params == {}


def test_chain_arrays_can_charge_a_tied_weight_at_both_ends() -> None:
    base = DagProblem.chain(time=[1.0, 1.0, 1.0])
    tied = DagProblem(**{**base.__dict__, "param_names": ("w",),
                         "param_bytes": np.array([64.0]), "param_readers": ((0, 2),)})
    obj = make_objective(tied, PartitionConfig(num_stages=3, memory_weight=1.0))
    unit = obj.b * obj.param_factor * 64.0
    assert chain_arrays(tied, np.arange(3), obj).work.tolist() == pytest.approx(
        [unit, 0.0, 0.0])  # first reader only: a bound
    both = chain_arrays(tied, np.arange(3), obj, replicas=True).work
    assert both.tolist() == pytest.approx([unit, 0.0, unit])
    # cut between the readers: the charge equals the exact evaluation per stage
    ev = evaluate(tied, np.array([0, 1, 2]), obj)
    assert ev.param_bytes.tolist() == pytest.approx((both / (obj.b * obj.param_factor)).tolist())


def test_graph_carries_the_problem() -> None:
    # 0 -> 1 -> 3, 0 -> 2 -> 3; node 0's output (100 B) is read by 1 and 2
    base = DagProblem.chain(time=[1.0, 2.0, 3.0, 4.0], saved=[5.0, 6.0, 7.0, 8.0],
                            params=[10.0, 0.0, 0.0, 30.0])
    p = DagProblem(**{**base.__dict__, "preds": ((), (0,), (0,), (1, 2)),
                      "val_producer": (0, 1, 2), "val_bytes": np.array([100.0, 20.0, 30.0]),
                      "val_consumers": ((1, 2), (3,), (3,)), "val_to_output": (False,) * 3,
                      "pins": (0, -1, -1, 1)})
    g = p.graph
    assert list(g.nodes) == [0, 1, 2, 3]
    assert g.nodes[3] == {"name": "n3", "time": 4.0, "memory": 8.0, "params": 30.0, "pin": 1}
    assert g.nodes[1]["pin"] == -1
    assert {(u, v): d["bytes"] for u, v, d in g.edges(data=True)} == {
        (0, 1): 100.0, (0, 2): 100.0, (1, 3): 20.0, (2, 3): 30.0}
    assert list(g.successors(0)) == [2, 1]  # decreasing: the "dfs" order's tie-break
    assert p.graph is g
