"""Collective communication as NCCL runs it: ring and tree, within and across nodes.

Why: at scale the plan is decided by what the collectives cost: tensor-parallel
all-reduces over NVLink inside a node, data-parallel all-reduces (or reduce-scatter +
all-gather) over the inter-node fabric, and how many groups share a node's network cards.
This module is the one place those formulas live; ``passes.tensor_parallel.costs`` prices the
tensor-parallel collectives of a rewritten graph with ``ring_steps`` and the cluster
planner (``smp_fx.planner``) prices every collective of a plan with ``collective_time``.

The model follows NCCL's own tuning model (``src/graph/tuning.cc``, ``ncclTopoTuneModel``
and ``ncclTopoGetAlgoTime``): time = latency + bytes / algorithm bandwidth, where

- **ring**: ``steps`` = 2 (n - 1) for an all-reduce, n - 1 for an all-gather or a
  reduce-scatter (``bytes`` is the full tensor, the gathered or the reduced one);
  algorithm bandwidth = bus bandwidth x n / steps; latency = one hop per step, the steps
  that cross nodes at the network's latency (2 (nodes - 1) of them for an all-reduce).
- **tree** (all-reduce only; NCCL's hierarchical algorithm: a chain inside each node, a
  double binary tree across nodes): algorithm bandwidth = 0.9 x bus bandwidth / 2;
  latency = 2 ((ranks per node - 1) intra hops + log2(nodes) network hops).
- the **bus bandwidth** of a group of ``n`` ranks spread over ``nodes`` nodes (``n / nodes``
  per node) is the per-GPU intra-node bandwidth on one node; across nodes it is the
  smaller of that and the node's network bandwidth shared by the groups that run at the
  same time on the node (``concurrent``: a node of 8 GPUs in 8 data-parallel groups of one
  rank per node gives each group one eighth of the node's network). Per ring step a node
  sends one ``1 / n`` part of the tensor out whatever its rank count, so the ranks of one
  group on a node do not divide it further.

NCCL picks the faster algorithm per call; ``collective_time`` does the same and says
which (``Collective.algorithm``). A point-to-point send (pipeline stages) is
``p2p_time``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from cost_model.errors import SMPConfigError

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
TREE_BANDWIDTH_FACTOR = 0.9
"""NCCL's tree bus bandwidth is 0.9 of the ring's (``tuning.cc``: ``busBw * .9``)."""


@dataclass(frozen=True)
class Fabric:
    """The links a collective runs over (bytes/s one direction; seconds per hop).

    ``intra_bandwidth``: what one GPU reaches to the others of its node (NVLink through
    NVSwitch: NCCL's bus bandwidth); ``inter_bandwidth``: one node's network, all its cards
    together; ``gpus_per_node``: GPUs sharing that network.
    """

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
    algorithm: str  # "ring", "tree" or "none" (one rank, no bytes)
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
    """A ring collective on one link model: ``steps`` messages of ``nbytes / size`` each,
    ``comm_time(bytes)`` apiece (latency + bytes / bandwidth: NCCL's ring on one node).

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
    """Seconds of one ``kind`` collective of ``nbytes`` (the full tensor) over ``size``
    ranks on ``nodes`` nodes, ``concurrent`` such groups sharing each node's network;
    the faster of ring and (all-reduce only) tree, as NCCL's tuner picks.

    >>> f = Fabric(300e9, 0.0, 200e9, 0.0, 8)
    >>> round(collective_time("all_reduce", 1e9, 8, f).seconds, 6)  # 2 * 7/8 * 1e9 / 3e11
    0.005833
    """
    steps = ring_steps(kind, size)
    if steps == 0 or nbytes <= 0:
        return Collective(0.0, "none", 0.0)
    if nodes < 1 or nodes > size or size % nodes:
        raise SMPConfigError.build("a group spreads evenly over its nodes", (size, nodes),
                                   "cost_model.collectives.collective_time",
                                   "give nodes dividing the group size")
    bus = bus_bandwidth(fabric, size, nodes, concurrent)
    inter_steps = ring_steps(kind, nodes)
    ring_lat = (steps - inter_steps) * fabric.intra_latency_s \
        + inter_steps * fabric.inter_latency_s
    ring = ring_lat + nbytes * steps / (size * bus)
    best = Collective(ring, "ring", bus)
    if kind == "all_reduce" and nodes > 1:
        per_node = size // nodes
        tree_lat = 2 * ((per_node - 1) * fabric.intra_latency_s
                        + math.log2(nodes) * fabric.inter_latency_s)
        tree = tree_lat + nbytes / (TREE_BANDWIDTH_FACTOR * bus / 2)
        if tree < ring:
            best = Collective(tree, "tree", TREE_BANDWIDTH_FACTOR * bus)
    return best


def p2p_time(nbytes: float, fabric: Fabric, *, across_nodes: bool) -> float:
    """One point-to-point send of ``nbytes``: within a node over NVLink, across nodes on
    one GPU's share of its node's network (every GPU of a pipeline sends at once).

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
