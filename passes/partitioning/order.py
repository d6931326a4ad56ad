"""Topological orders of a DAG's compute nodes, chosen to keep live tensors across cuts small.

``auto_partition`` solves on each of ``graph``, ``dfs``, ``min_live`` (and ``pins``) and
keeps the best, because none wins everywhere; ties break by node index.
See docs/partitioning.md, 'The solver in detail'.
"""

from __future__ import annotations

import heapq

import numpy as np

from cost_model.errors import SMPPartitionError
from passes.partitioning.problem import DagProblem

ORDERS = ("graph", "dfs", "min_live")
PIN_ORDER = "pins"


def _path_text(problem: DagProblem, path: list[int]) -> str:
    return " -> ".join(problem.names[v] for v in path)


def check_dag(problem: DagProblem) -> None:
    """Raise unless every edge goes from a lower to a higher node index (networkx names a
    cycle when there is one)."""
    backward = problem.backward_edge
    if backward is None:
        return
    import networkx as nx  # here, not at import (passes.partitioning.problem)

    try:
        cycle = [u for u, _ in nx.find_cycle(problem.graph)]
    except nx.NetworkXNoCycle:
        raise SMPPartitionError.build(
            "compute nodes must be numbered in a topological order",
            _path_text(problem, list(backward)), "DagProblem.preds",
            "number the nodes in graph order (problem_from_graph does)") from None
    raise SMPPartitionError.build(
        "the compute graph has a cycle", _path_text(problem, [*cycle, cycle[0]]),
        "DagProblem.preds", "partition an fx graph (always acyclic)")


def pin_bounds(problem: DagProblem) -> tuple[np.ndarray, np.ndarray]:
    """Per node, the earliest stage it may go to (largest pin among its ancestors) and the
    latest (smallest among its descendants), in two sweeps rather than quadratic searches."""
    n = problem.n
    pins = problem.pin_array().tolist()
    big = max(pins, default=-1) + 1
    lo = [max(p, 0) for p in pins]
    for v, ps in enumerate(problem.preds):
        for p in ps:
            if lo[p] > lo[v]:
                lo[v] = lo[p]
    hi = [p if p >= 0 else big for p in pins]
    succs = problem.succs()
    for v in range(n - 1, -1, -1):
        for u in succs[v]:
            if hi[u] < hi[v]:
                hi[v] = hi[u]
    return np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)


def check_pins(problem: DagProblem) -> None:
    """Raise if a value flows from a node pinned later to one pinned earlier, naming the path."""
    pins = problem.pin_array()
    if not np.any(pins >= 0):
        return
    lo, _ = pin_bounds(problem)
    late = np.flatnonzero((pins >= 0) & (lo > pins))
    if not late.size:
        return
    import networkx as nx

    v = int(late[0])
    graph = problem.graph
    u = min(a for a in nx.ancestors(graph, v) if pins[a] == lo[v])
    path = nx.shortest_path(graph, u, v)
    raise SMPPartitionError.build(
        "a pinned node feeds a node pinned to an earlier stage: no contiguous plan exists",
        f"{_path_text(problem, path)} (pinned to {int(pins[u])} and {int(pins[v])})",
        "the pins of smp.partition / set_partition",
        "pin in execution order (earlier modules on lower or equal partitions)")


def _min_live(problem: DagProblem) -> list[int]:
    """List scheduling by live-byte growth, with ``heapq``: a node's priority is fixed only
    when it becomes ready."""
    n = problem.n
    val_bytes = problem.val_bytes.tolist()
    succs = problem.succs()
    indeg = [len(set(p)) for p in problem.preds]
    produced = [0.0] * n
    uses_left = [0] * len(val_bytes)
    reads: list[list[int]] = [[] for _ in range(n)]
    for v, (p, cons) in enumerate(zip(problem.val_producer, problem.val_consumers)):
        if p >= 0:
            produced[p] += val_bytes[v]
        readers = set(cons)
        uses_left[v] = len(readers)
        for c in readers:
            reads[c].append(v)

    def key(u: int) -> tuple[float, int]:
        freed = 0.0
        for v in reads[u]:
            if uses_left[v] == 1:
                freed += val_bytes[v]
        return (produced[u] - freed, u)

    heap = [key(v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(heap)
    out: list[int] = []
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        _, v = pop(heap)
        out.append(v)
        for val in reads[v]:
            uses_left[val] -= 1
        for u in succs[v]:
            indeg[u] -= 1
            if indeg[u] == 0:
                push(heap, key(u))
    return out


def topological_order(problem: DagProblem, kind: str) -> np.ndarray:
    """A permutation of ``0..n-1`` in which every node follows its predecessors."""
    import networkx as nx

    n = problem.n
    check_dag(problem)
    if kind == "graph":
        return np.arange(n, dtype=np.int64)
    if kind == "dfs":
        out = list(nx.dfs_postorder_nodes(problem.graph))[::-1]
    elif kind == "min_live":
        out = _min_live(problem)
    elif kind == PIN_ORDER:
        lo, hi = pin_bounds(problem)
        lo_l, hi_l = lo.tolist(), hi.tolist()
        out = list(nx.lexicographical_topological_sort(
            problem.graph, key=lambda v: (hi_l[v], lo_l[v], v)))
    else:
        raise SMPPartitionError.build("unknown topological order", kind,
                                      "topological_order", f"use {(*ORDERS, PIN_ORDER)}")
    return np.asarray(out, dtype=np.int64)
