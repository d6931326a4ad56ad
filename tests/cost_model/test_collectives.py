"""The collective formulas: NCCL's ring and tree, groups across nodes, point-to-point."""

from __future__ import annotations

import math

import pytest

from cost_model.collectives import (
    Fabric,
    bus_bandwidth,
    collective_time,
    p2p_time,
    ring_over,
    ring_steps,
)
from cost_model.errors import SMPConfigError
from passes.tensor_parallel.costs import collective_time as tp_collective_time

DGX = Fabric(intra_bandwidth=235e9, intra_latency_s=5e-6, inter_bandwidth=180e9,
             inter_latency_s=10e-6, gpus_per_node=8)


def test_ring_steps() -> None:
    assert [ring_steps("all_reduce", n) for n in (1, 2, 8)] == [0, 2, 14]
    assert [ring_steps("all_gather", n) for n in (1, 2, 8)] == [0, 1, 7]
    assert ring_steps("reduce_scatter", 4) == 3
    with pytest.raises(SMPConfigError, match="collective is one of"):
        ring_steps("broadcast", 4)


def test_tensor_parallel_costs_use_the_one_ring_formula() -> None:
    def comm(n: float) -> float:
        return 3e-6 + n / 2e11

    for kind in ("all_reduce", "all_gather", "reduce_scatter", None):
        for size in (1, 2, 4, 8):
            assert tp_collective_time(kind, 6e7, size, comm) == ring_over(kind, 6e7, size, comm)
    # 2 (p - 1) messages of n / p each
    assert ring_over("all_reduce", 8e6, 4, comm) == pytest.approx(6 * comm(2e6))


def test_ring_inside_a_node_is_nccl_bus_bandwidth_formula() -> None:
    n = 1e9
    c = collective_time("all_reduce", n, 8, DGX)
    assert c.algorithm == "ring"
    assert c.seconds == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * n / 235e9)
    g = collective_time("all_gather", n, 8, DGX)
    assert g.seconds == pytest.approx(7 * 5e-6 + 7 / 8 * n / 235e9)
    assert collective_time("reduce_scatter", n, 8, DGX).seconds == pytest.approx(g.seconds)


def test_across_nodes_the_network_bounds_the_ring_and_is_shared() -> None:
    n = 4e9
    # 32 ranks on 4 whole nodes: the bus runs at the node's network, the only 6 of the 62
    # steps that cross nodes pay the network latency
    c = collective_time("all_reduce", n, 32, DGX, nodes=4)
    assert c.bus_bandwidth == 180e9
    assert c.seconds == pytest.approx(56 * 5e-6 + 6 * 10e-6 + 62 / 32 * n / 180e9)
    # one rank per node, 8 groups on every node (tp = 8): each gets an eighth of the network
    one = collective_time("all_reduce", n, 4, DGX, nodes=4, concurrent=8)
    assert one.bus_bandwidth == pytest.approx(180e9 / 8)
    assert one.seconds > 7 * collective_time("all_reduce", n, 4, DGX, nodes=4).seconds
    assert bus_bandwidth(DGX, 16, 2, concurrent=1) == 180e9


def test_tree_wins_for_small_messages_across_many_nodes() -> None:
    small = collective_time("all_reduce", 1e3, 512, DGX, nodes=512)
    assert small.algorithm == "tree"
    ring_latency = 2 * 511 * 10e-6
    tree_latency = 2 * math.log2(512) * 10e-6
    assert small.seconds == pytest.approx(tree_latency + 1e3 / (0.9 * 180e9 / 2))
    assert small.seconds < ring_latency
    big = collective_time("all_reduce", 1e10, 512, DGX, nodes=512)
    assert big.algorithm == "ring"  # the tree moves twice the bytes per rank


def test_nothing_to_move_costs_nothing() -> None:
    assert collective_time("all_reduce", 1e9, 1, DGX).seconds == 0.0
    assert collective_time("all_reduce", 0.0, 8, DGX).algorithm == "none"
    assert p2p_time(0, DGX, across_nodes=True) == 0.0


def test_point_to_point_inside_and_across_nodes() -> None:
    assert p2p_time(1e8, DGX, across_nodes=False) == pytest.approx(5e-6 + 1e8 / 235e9)
    # across nodes every GPU of the node sends at once: one eighth of the network each
    assert p2p_time(1e8, DGX, across_nodes=True) == pytest.approx(10e-6 + 1e8 / (180e9 / 8))


def test_bad_fabric_and_group_rejected() -> None:
    with pytest.raises(SMPConfigError, match="intra_bandwidth must be > 0"):
        Fabric(0.0, 0.0, 1.0, 0.0, 8)
    with pytest.raises(SMPConfigError, match="latency >= 0"):
        Fabric(1.0, -1.0, 1.0, 0.0, 8)
    with pytest.raises(SMPConfigError, match="gpus_per_node"):
        Fabric(1.0, 0.0, 1.0, 0.0, 0)
    with pytest.raises(SMPConfigError, match="spans 1 to size nodes"):
        collective_time("all_reduce", 1e6, 6, DGX, nodes=7)


def test_a_group_spanning_nodes_unevenly_runs_at_the_network_s_pace() -> None:
    n = 1e8
    uneven = collective_time("all_gather", n, 3, DGX, nodes=2)  # e.g. ranks 0, 4, 8
    assert uneven.bus_bandwidth == min(DGX.intra_bandwidth, DGX.inter_bandwidth)
    assert uneven.seconds > collective_time("all_gather", n, 3, DGX).seconds
    tree = collective_time("all_reduce", 1e3, 6, DGX, nodes=4)  # fullest node holds 2
    assert tree.seconds > 0


def test_all_to_all_sends_directly_and_crosses_the_fullest_node_s_network() -> None:
    n = 1e8
    inside = collective_time("all_to_all", n, 8, DGX)
    assert inside.seconds == pytest.approx(DGX.intra_latency_s + n * 7 / 8 / DGX.intra_bandwidth)
    across = collective_time("all_to_all", n, 16, DGX, nodes=2, concurrent=1)
    assert across.seconds == pytest.approx(DGX.inter_latency_s
                                           + 8 * n * 8 / 16 / DGX.inter_bandwidth)
    assert collective_time("all_to_all", n, 16, DGX, nodes=2, concurrent=2).seconds > \
        across.seconds
