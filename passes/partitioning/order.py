"""Topological orders of a DAG's compute nodes, chosen to keep live tensors across cuts small.

The chain solver cuts an order, and a cut's communication is every value produced before
and consumed after it; an order that interleaves independent branches keeps both live
across many cuts. Three orders are offered; ``auto_partition`` solves on each and keeps
the best, because none wins everywhere:

* ``"graph"``: the order the graph was traced in (program order; good for sequential code).
* ``"dfs"``: finishes the branch it is on before starting another (LIFO list scheduling).
* ``"min_live"``: at every step runs the ready node that adds the fewest live bytes
  (bytes it produces minus inputs it frees), a greedy register-pressure heuristic.

All are deterministic: ties break by node index. With pins, ``"pins"`` (list scheduling
by the latest stage a node may go to, then the earliest it must go to) gives an order in
which every pin can be honoured by contiguous stages whenever any order can.
"""

from __future__ import annotations

import heapq

import numpy as np

from cost_model.errors import SMPPartitionError
from passes.partitioning.problem import DagProblem

ORDERS = ("graph", "dfs", "min_live")
PIN_ORDER = "pins"


def topological_order(problem: DagProblem, kind: str) -> np.ndarray:
    """A permutation of ``0..n-1`` in which every node follows its predecessors."""
    n = problem.n
    if kind == "graph":
        return np.arange(n, dtype=np.int64)
    succs = problem.succs()
    indeg = np.array([len(set(p)) for p in problem.preds], dtype=np.int64)
    out: list[int] = []
    if kind == "dfs":
        stack = [v for v in range(n - 1, -1, -1) if indeg[v] == 0]
        while stack:
            v = stack.pop()
            out.append(v)
            for u in reversed(succs[v]):
                indeg[u] -= 1
                if indeg[u] == 0:
                    stack.append(u)
    elif kind == "min_live":
        produced = np.zeros(n)
        uses_left = np.zeros(len(problem.val_bytes), dtype=np.int64)
        reads: list[list[int]] = [[] for _ in range(n)]
        for v, (p, cons) in enumerate(zip(problem.val_producer, problem.val_consumers)):
            if p >= 0:
                produced[p] += problem.val_bytes[v]
            uses_left[v] = len(set(cons))
            for c in set(cons):
                reads[c].append(v)

        def key(u: int) -> tuple[float, int]:
            freed = sum(problem.val_bytes[v] for v in reads[u] if uses_left[v] == 1)
            return (float(produced[u] - freed), u)

        heap = [key(v) for v in range(n) if indeg[v] == 0]
        heapq.heapify(heap)
        while heap:
            _, v = heapq.heappop(heap)
            out.append(v)
            for val in reads[v]:
                uses_left[val] -= 1
            for u in succs[v]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(heap, key(u))
    elif kind == PIN_ORDER:
        pins = problem.pin_array()
        big = int(pins.max()) + 1 if n else 0
        lo = np.where(pins >= 0, pins, 0)
        for v in range(n):  # the earliest stage v may go to: its pinned ancestors'
            for p in problem.preds[v]:
                lo[v] = max(lo[v], lo[p])
        hi = np.where(pins >= 0, pins, big)
        for v in range(n - 1, -1, -1):  # the latest: its pinned descendants'
            for u in succs[v]:
                hi[v] = min(hi[v], hi[u])
        heap = [(int(hi[v]), int(lo[v]), v) for v in range(n) if indeg[v] == 0]
        heapq.heapify(heap)
        while heap:
            v = heapq.heappop(heap)[2]
            out.append(v)
            for u in succs[v]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(heap, (int(hi[u]), int(lo[u]), u))
    else:
        raise SMPPartitionError.build("unknown topological order", kind,
                                      fix=f"use {(*ORDERS, PIN_ORDER)}")
    if len(out) != n:
        raise SMPPartitionError.build("the compute graph has a cycle", f"{len(out)} of {n}",
                                      fix="partition an fx graph (always acyclic)")
    return np.asarray(out, dtype=np.int64)
