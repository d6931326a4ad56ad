"""Boundary refinement by minimum cut: move a group of nodes between two neighbouring stages
so that fewer bytes cross the boundary between them.

Some boundaries get cheaper only when several nodes move together, which ``refine``'s
single moves cannot find; a link-bound costliest stage is re-cut at a minimum s-t cut of
a hyperedge network over a window around its boundary. See docs/partitioning.md,
'The solver in detail'.
"""

from __future__ import annotations

from collections.abc import Collection
from math import ceil
from typing import TYPE_CHECKING, Union

import numpy as np

from passes.partitioning.problem import DagProblem, Objective, evaluate

if TYPE_CHECKING:  # imported where used (passes.partitioning.problem says why)
    import networkx as nx

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
    import networkx as nx

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
    import networkx as nx
    from networkx.algorithms.flow import boykov_kolmogorov

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
