"""Collective communication as NCCL runs it: ring and tree, within and across nodes.

At scale a plan is decided by what the collectives cost, so their formulas live here
once: the tensor-parallel pricing uses ``ring_steps``, the cluster planner
``collective_time``. The model follows NCCL's tuning model (``src/graph/tuning.cc``).
See docs/planning.md, 'One cost model'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from cost_model.errors import SMPConfigError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""``all_to_all``: ``nbytes`` is one rank's buffer, ``1/size`` of it kept, the rest sent
to the other ranks directly (``algorithm`` ``direct``), not around a ring."""
TREE_BANDWIDTH_FACTOR = 0.9
"""NCCL's tree bus bandwidth is 0.9 of the ring's (``tuning.cc``: ``busBw * .9``)."""


@dataclass(frozen=True)
class Fabric:
    """The links a collective runs over (bytes/s one direction; seconds per hop).

    ``inter_bandwidth`` is one node's network, all cards together, shared by its GPUs."""

    intra_bandwidth: float
    intra_latency_s: float
    inter_bandwidth: float
    inter_latency_s: float
    gpus_per_node: int

    def __post_init__(self) -> None:
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if not float(getattr(self, name)) > 0:
                raise SMPConfigError.build(f"{name} must be > 0", getattr(self, name),
                                           f"Fabric.{name}", "give a positive bytes/s figure")
        for name in ("intra_latency_s", "inter_latency_s"):
            if not float(getattr(self, name)) >= 0:
                raise SMPConfigError.build(f"{name} must be >= 0", getattr(self, name),
                                           f"Fabric.{name}", "give a latency >= 0 seconds")
        if int(self.gpus_per_node) < 1:
            raise SMPConfigError.build("gpus_per_node must be >= 1", self.gpus_per_node,
                                       "Fabric.gpus_per_node", "give the GPUs of one node")


@dataclass(frozen=True)
class Collective:
    """The time of one collective and how NCCL would run it."""

    seconds: float
    algorithm: str  # "ring", "tree", "direct" (all-to-all) or "none" (one rank, no bytes)
    bus_bandwidth: float


def ring_steps(kind: str | None, size: int) -> int:
    """Point-to-point steps of a ring collective over ``size`` ranks.

    >>> ring_steps("all_reduce", 4), ring_steps("all_gather", 4), ring_steps(None, 4)
    (6, 3, 0)
    """
    if kind is None or size <= 1:
        return 0
    if kind not in KINDS:
        raise SMPConfigError.build("a collective is one of " + ", ".join(KINDS), kind,
                                   "cost_model.collectives", "name a known collective")
    return 2 * (size - 1) if kind == "all_reduce" else size - 1


def ring_over(kind: str | None, nbytes: float, size: int,
              comm_time: Callable[[float], float]) -> float:
    """A ring collective on one link model: ``steps`` messages of ``nbytes / size`` each.

    >>> ring_over("all_reduce", 8e6, 2, lambda n: 1e-4 + n / 1e9)
    0.0082
    """
    steps = ring_steps(kind, size)
    if steps == 0 or nbytes <= 0:
        return 0.0
    return steps * comm_time(nbytes / size)


def bus_bandwidth(fabric: Fabric, size: int, nodes: int, concurrent: int = 1) -> float:
    """Bytes/s per rank a ring of ``size`` ranks on ``nodes`` nodes moves (module doc).

    >>> f = Fabric(300e9, 1e-6, 200e9, 5e-6, 8)
    >>> bus_bandwidth(f, 8, 1), bus_bandwidth(f, 32, 4), bus_bandwidth(f, 4, 4, concurrent=8)
    (300000000000.0, 200000000000.0, 25000000000.0)
    """
    if nodes <= 1:
        return fabric.intra_bandwidth
    # per ring step each node sends 1/size of the tensor out, whatever its rank count
    return min(fabric.intra_bandwidth, fabric.inter_bandwidth / max(concurrent, 1))


def collective_time(kind: str, nbytes: float, size: int, fabric: Fabric, *, nodes: int = 1,
                    concurrent: int = 1) -> Collective:
    """Seconds of one collective over ``size`` ranks on ``nodes`` nodes: the faster of ring
    and (all-reduce only) tree, as NCCL's tuner picks.

    >>> f = Fabric(300e9, 0.0, 200e9, 0.0, 8)
    >>> round(collective_time("all_reduce", 1e9, 8, f).seconds, 6)  # 2 * 7/8 * 1e9 / 3e11
    0.005833
    """
    steps = ring_steps(kind, size)
    if steps == 0 or nbytes <= 0:
        return Collective(0.0, "none", 0.0)
    if nodes < 1 or nodes > size:
        raise SMPConfigError.build("a group spans 1 to size nodes", (size, nodes),
                                   "cost_model.collectives.collective_time",
                                   "give nodes between 1 and the group size")
    if kind == "all_to_all":
        return _all_to_all(nbytes, size, fabric, nodes, concurrent)
    bus = bus_bandwidth(fabric, size, nodes, concurrent)
    inter_steps = ring_steps(kind, nodes)
    ring_lat = (steps - inter_steps) * fabric.intra_latency_s \
        + inter_steps * fabric.inter_latency_s
    ring = ring_lat + nbytes * steps / (size * bus)
    best = Collective(ring, "ring", bus)
    if kind == "all_reduce" and nodes > 1:
        per_node = -(-size // nodes)  # the fullest node's chain
        tree_lat = 2 * ((per_node - 1) * fabric.intra_latency_s
                        + math.log2(nodes) * fabric.inter_latency_s)
        tree = tree_lat + nbytes / (TREE_BANDWIDTH_FACTOR * bus / 2)
        if tree < ring:
            best = Collective(tree, "tree", TREE_BANDWIDTH_FACTOR * bus)
    return best


def _all_to_all(nbytes: float, size: int, fabric: Fabric, nodes: int,
                concurrent: int) -> Collective:
    """Every rank sends ``1/size`` of ``nbytes`` to each other rank at once: each GPU's
    NVLink carries its ``(size - 1)/size``; the fullest node's network (shared by
    ``concurrent`` crossing groups) carries what its ranks send off the node.

    >>> f = Fabric(300e9, 0.0, 200e9, 0.0, 8)
    >>> collective_time("all_to_all", 8e9, 16, f, nodes=2).seconds  # 8 x 8e9 x 8/16 / 2e11
    0.16
    """
    local = -(-size // nodes)
    intra = nbytes * (size - 1) / size / fabric.intra_bandwidth
    if nodes == 1:
        return Collective(fabric.intra_latency_s + intra, "direct", fabric.intra_bandwidth)
    off_node = local * nbytes * (size - local) / size
    inter = off_node * max(concurrent, 1) / fabric.inter_bandwidth
    return Collective(fabric.inter_latency_s + max(intra, inter), "direct",
                      fabric.inter_bandwidth / max(concurrent, 1))


def p2p_time(nbytes: float, fabric: Fabric, *, across_nodes: bool) -> float:
    """One point-to-point send; across nodes on one GPU's share of the node's network.

    >>> p2p_time(25e6, Fabric(300e9, 0.0, 200e9, 0.0, 8), across_nodes=True)
    0.001
    """
    if nbytes <= 0:
        return 0.0
    if across_nodes:
        share = fabric.inter_bandwidth / fabric.gpus_per_node
        return fabric.inter_latency_s + nbytes / min(share, fabric.intra_bandwidth)
    return fabric.intra_latency_s + nbytes / fabric.intra_bandwidth


__all__ = ["KINDS", "TREE_BANDWIDTH_FACTOR", "Collective", "Fabric", "bus_bandwidth",
           "collective_time", "p2p_time", "ring_over", "ring_steps"]
