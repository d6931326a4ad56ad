"""The shared objective, checked against the formula by hand on a 3-node chain."""

from __future__ import annotations

import numpy as np
import pytest

from passes.partition_config import PartitionConfig
from passes.partitioning.problem import DagProblem, chain_arrays, evaluate, make_objective


def test_objective_by_hand() -> None:
    p = DagProblem.chain(time=[1.0, 2.0, 3.0], saved=[10.0, 20.0, 30.0],
                         out_bytes=[100.0, 200.0, 300.0], params=[1000.0, 0.0, 500.0])
    cfg = PartitionConfig(num_stages=2, memory_weight=0.25, microbatches=3,
                          pipeline="interleaved", optimizer_state_factor=2.0,
                          link_bandwidth=100.0, link_latency_s=0.5)
    obj = make_objective(p, cfg)
    assert obj.time_total == 6.0
    assert obj.memory_total == 4 * 1500.0 + 60.0 * 3  # params x (1 + 1 + 2), saved x m
    assert obj.inflight == (2, 1)  # min(p - s, m)
    ev = evaluate(p, np.array([0, 0, 1]), obj)
    assert ev.comm_bytes.tolist() == [200.0, 0.0]  # node 1's output crosses the boundary
    t0 = (3.0 + 0.5 + 200.0 / 100.0) / 6.0
    m0 = (4 * 1000.0 + 30.0 * 2) / obj.memory_total
    t1 = 3.0 / 6.0
    m1 = (4 * 500.0 + 30.0 * 1) / obj.memory_total
    assert ev.cost.tolist() == pytest.approx([0.75 * t0 + 0.25 * m0, 0.75 * t1 + 0.25 * m1])
    work, saved, comm = chain_arrays(p, np.arange(3), obj)
    assert comm[2] == pytest.approx(0.75 * 2.5 / 6.0) and comm[1] == pytest.approx(
        0.75 * 1.5 / 6.0)


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
