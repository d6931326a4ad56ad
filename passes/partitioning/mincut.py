"""Boundary refinement by minimum cut: move a group of nodes between two neighbouring stages
so that fewer bytes cross the boundary between them.

``refine`` moves one node at a time, and some boundaries only get cheaper when several
nodes move together: a large value read by two nodes of the next stage keeps crossing
until both readers move, and moving either one alone adds its own output to the boundary.
When the costliest stage is link-bound (its send outlasts its compute, ``problem``), the
bytes across its boundary set its cost, and the cheapest boundary between it and the next
stage is a minimum s-t cut (``networkx.minimum_cut``) of this network:

* every value touching a free node is a hyperedge: an in-node and an out-node joined by
  its bytes, each member (producer, readers) -> in-node and out-node -> member unbounded.
  The cut pays the bytes once iff the value has members on both sides, which is the
  objective's rule: a value crosses iff it is produced at or before the boundary and read
  after it (two members: one edge each way instead);
* convexity: for every edge ``u -> v``, an unbounded edge ``v -> u``, so a node on the
  earlier side has its predecessors there too and the stages still only send forward;
* nodes that stay put are the source (the earlier side: stages ``<= s``) or the sink.

The cut ignores time and memory, so the free nodes are a window around the boundary: the
last fraction ``f`` of stage ``s`` and the first ``f`` of stage ``s + 1`` (node index is a
topological order), ``f`` in ``WINDOWS``, at most ``MAX_FREE`` nodes a side. Each candidate
is scored with the exact objective (``problem.evaluate``); the best is kept if it lowers
the larger of the two stages' costs below the costliest stage's. Nodes that feed the
output or are pinned stay, and a stage keeps a node doing real work when ``refine`` asks
it to. The cap bounds the work: networkx's flows are pure Python (about 15 ms for a window
of 2 x 64 nodes of a 10,000-node DAG, 0.1-0.5 s for 2 x 600), and every improving window
on the benchmark graphs had fewer than 100 free nodes. For the same reason no flow runs
when the link's excess over compute is under ``MIN_LINK_SHARE`` of the stage's cost: fewer
bytes alone save at most that excess, every improving cut on those graphs had at least
2.7 %, and a 10,000-node DAG at 64 stages otherwise ran five fruitless flows on a stage
whose link was 0.1 % of its cost.

Capacities are whole bytes, so the flow is exact, and networkx returns the cut whose sink
side is every node that reaches the sink in the residual graph: the same for every maximum
flow, so the plan does not depend on the flow algorithm (Boykov-Kolmogorov, the fastest of
networkx's on these networks) or the networkx version.
"""

from __future__ import annotations

from collections.abc import Collection
from math import ceil
from typing import Union

import networkx as nx
import numpy as np
from networkx.algorithms.flow import boykov_kolmogorov

from passes.partitioning.problem import DagProblem, Objective, evaluate

WINDOWS = (0.125, 0.25, 0.5, 1.0)
MAX_FREE = 64
MIN_LINK_SHARE = 0.01
SOURCE, SINK = "source", "sink"

Endpoint = Union[int, str]


def _network(problem: DagProblem, stage: np.ndarray, s: int, free: set[int]) -> nx.DiGraph:
    """The flow network of the free nodes between stage ``s`` and ``s + 1`` (module doc)."""
    out_stage = int(max((stage[i] for i in problem.output_inputs), default=stage.max()))

    def side(v: int) -> Endpoint:
        if v in free:
            return v
        return SOURCE if stage[v] <= s else SINK

    cap: dict[tuple[Endpoint, Endpoint], float] = {}  # inf: unbounded
    for v in sorted(free):
        for u in problem.preds[v]:
            if u not in free and stage[u] <= s:
                continue  # an earlier predecessor allows either side
            cap[(v, side(u))] = np.inf
        for w in problem.succs()[v]:
            if w not in free and stage[w] > s:
                continue
            cap[(side(w), v)] = np.inf
    vals = sorted({val for v in free for val in problem._touching[0][v]})
    for val in vals:
        members: list[Endpoint] = []
        prod = problem.val_producer[val]
        for m in ([prod] if prod >= 0 else []) + list(problem.val_consumers[val]):
            members.append(side(m))
        if problem.val_to_output[val]:
            members.append(SOURCE if out_stage <= s else SINK)
        ends = list(dict.fromkeys(members))
        nbytes = float(round(problem.val_bytes[val]))
        if len(ends) < 2 or nbytes <= 0 or (SOURCE in ends and SINK in ends):
            continue  # never crosses, or always does: no choice to make
        if len(ends) == 2:
            a, b = ends
            for edge in ((a, b), (b, a)):
                cap[edge] = cap.get(edge, 0.0) + nbytes
            continue
        e_in, e_out = f"in{val}", f"out{val}"
        cap[(e_in, e_out)] = nbytes
        for end in ends:
            cap[(end, e_in)] = np.inf
            cap[(e_out, end)] = np.inf
    net = nx.DiGraph()
    net.add_nodes_from((SOURCE, SINK))
    for (a, b), c in cap.items():
        if a == b or a == SINK or b == SOURCE:
            continue
        if np.isinf(c):
            net.add_edge(a, b)  # no capacity attribute: unbounded
        else:
            net.add_edge(a, b, capacity=int(c))
    return net


def min_cut_assignment(problem: DagProblem, stage: np.ndarray, s: int,
                       free: Collection[int]) -> np.ndarray:
    """``stage`` with the ``free`` nodes (all on stages ``s`` and ``s + 1``) re-split between
    the two at a convex cut of least bytes across the boundary after stage ``s``."""
    st = np.asarray(stage, dtype=np.int64)
    net = _network(problem, st, s, set(free))
    _, (_, sink_side) = nx.minimum_cut(net, SOURCE, SINK, flow_func=boykov_kolmogorov)
    out = st.copy()
    for v in free:
        out[v] = s + 1 if v in sink_side else s
    return out


def cut_boundary(problem: DagProblem, obj: Objective, stage: np.ndarray, s: int,
                 frozen: Collection[int], keep_heavy: bool) -> np.ndarray | None:
    """A new assignment that lowers ``max(cost[s], cost[s + 1])`` below ``cost[s]`` by
    re-cutting the boundary after stage ``s`` at a minimum cut, or None."""
    st = np.asarray(stage, dtype=np.int64)
    ev = evaluate(problem, st, obj)
    excess = obj.a * (ev.link_time_s[s] - ev.time_s[s])  # what fewer bytes could save at most
    if excess < MIN_LINK_SHARE * ev.cost[s]:
        return None
    target = float(ev.cost[s]) * (1.0 - 1e-12)
    left = [int(v) for v in np.flatnonzero(st == s) if v not in frozen]
    right = [int(v) for v in np.flatnonzero(st == s + 1) if v not in frozen]
    heavy = problem.heavy()
    best: tuple[float, np.ndarray] | None = None
    tried: list[set[int]] = []
    for f in WINDOWS:
        nl, nr = (min(ceil(f * len(side)), MAX_FREE) for side in (left, right))
        free = set(left[len(left) - nl:]) | set(right[:nr])
        if not free or free in tried:
            continue
        tried.append(free)
        cand = min_cut_assignment(problem, st, s, free)
        moved = [cand == s, cand == s + 1]
        if not all(m.any() for m in moved) or np.array_equal(cand, st):
            continue
        if keep_heavy and not all((m & heavy).any() for m in moved):
            continue
        cost = evaluate(problem, cand, obj).cost
        score = float(max(cost[s], cost[s + 1]))
        if score < target and (best is None or score < best[0]):
            best = (score, cand)
    return None if best is None else best[1]
