"""Local refinement of a stage assignment: move boundary nodes between adjacent stages.

The chain solve is exact for the order it was given, but a DAG has many orders and the
chain model counts a shared parameter once; moving a node that sits on a stage boundary
(all its successors on the next stage, or all its predecessors on the previous one) to
that neighbour keeps the quotient graph acyclic and can lower the largest stage cost.

Each step takes the costliest stage (lowest index on ties) and applies the single move
that most lowers ``max(cost of that stage, cost of the neighbour)``; the sorted vector of
stage costs decreases lexicographically, so it terminates. Costs are kept incrementally:
a move from ``s`` to ``s +- 1`` changes only those two stages (the bytes across every
other boundary are unchanged), so one step costs O(nodes on the stage x their degree).
Nodes feeding the graph output and pinned nodes never move, and when every stage holds a
node doing real work (``DagProblem.heavy``) no move takes a stage's last one.

When no single move helps and the costliest stage is link-bound (its send outlasts its
compute), ``mincut.cut_boundary`` re-cuts its boundary at a minimum cut, moving a group
of nodes at once; the loop then goes on from the new assignment. Compute-bound plans never
reach it, so it costs nothing there.
"""

from __future__ import annotations

import numpy as np

from passes.partitioning.mincut import cut_boundary
from passes.partitioning.problem import DagProblem, Objective, value_spans


class _State:
    def __init__(self, problem: DagProblem, obj: Objective, stage: np.ndarray,
                 keep_heavy: bool | None = None) -> None:
        self.p, self.obj = problem, obj
        self.k = obj.num_stages
        self.st = np.array(stage, dtype=np.int64)
        k = self.k
        self.time = np.bincount(self.st, weights=problem.time, minlength=k).astype(float)
        self.saved = np.bincount(self.st, weights=problem.saved, minlength=k).astype(float)
        self.count = np.bincount(self.st, minlength=k)
        self.heavy = problem.heavy()
        self.hcount = np.bincount(self.st[self.heavy], minlength=k)
        # never take a stage's last heavy node, if every stage had one to begin with
        self.keep_heavy = bool(np.all(self.hcount > 0)) if keep_heavy is None else keep_heavy
        self.succs = problem.succs()
        self.vals_of, self.params_of = problem._touching
        self.refs = np.zeros((len(problem.param_names), k), dtype=np.int64)
        rflat, rparam = problem._flat[5:]
        np.add.at(self.refs, (rparam, self.st[rflat]), 1)
        self.pmem = (problem.param_bytes[:, None] * (self.refs > 0)).sum(axis=0) \
            if len(problem.param_names) else np.zeros(k)
        self.out_stage = int(max((self.st[i] for i in problem.output_inputs),
                                 default=self.st.max()))
        self.frozen = set(problem.output_inputs) | {
            i for i, pin in enumerate(problem.pins) if pin >= 0}
        first, last = value_spans(problem, self.st)
        diff = np.zeros(k + 1)
        np.add.at(diff, first, problem.val_bytes)
        np.add.at(diff, last, -problem.val_bytes)
        self.bytes = np.cumsum(diff)[:k]
        self.cost = np.array([self._cost(s) for s in range(k)])

    def _span(self, v: int) -> tuple[int, int]:
        p = self.p
        cst = [int(self.st[c]) for c in p.val_consumers[v]]
        prod = p.val_producer[v]
        first = int(self.st[prod]) if prod >= 0 else min(cst, default=self.out_stage)
        last = max(cst, default=first)
        if p.val_to_output[v]:
            last = max(last, self.out_stage)
        return first, last

    def _cost(self, s: int, dtime: float = 0.0, dbytes: float = 0.0, dparam: float = 0.0,
              dsaved: float = 0.0) -> float:
        return self.obj.stage_cost(s, self.time[s] + dtime, self.bytes[s] + dbytes,
                                   self.pmem[s] + dparam, self.saved[s] + dsaved)

    def link_bound(self, s: int) -> bool:
        """Whether stage ``s``'s send outlasts its compute: its boundary bytes set its cost."""
        return self.obj.link_s(s, self.bytes[s]) > self.time[s]

    def movable(self, v: int, t: int) -> bool:
        s = int(self.st[v])
        if v in self.frozen or self.count[s] <= 1:
            return False
        if self.keep_heavy and self.heavy[v] and self.hcount[s] <= 1:
            return False
        if t > s:
            return all(self.st[u] >= t for u in self.succs[v])
        return all(self.st[u] <= t for u in self.p.preds[v])

    def delta(self, v: int, t: int) -> tuple[float, float, float]:
        """(new cost of v's stage, new cost of t, boundary byte change) if v moved to t."""
        s = int(self.st[v])
        b = min(s, t)
        before = 0.0
        after = 0.0
        for val in self.vals_of[v]:
            f, last = self._span(val)
            before += self.p.val_bytes[val] * (f <= b < last)
        self.st[v] = t
        for val in self.vals_of[v]:
            f, last = self._span(val)
            after += self.p.val_bytes[val] * (f <= b < last)
        self.st[v] = s
        dp_s = -sum(self.p.param_bytes[q] for q in self.params_of[v] if self.refs[q, s] == 1)
        dp_t = sum(self.p.param_bytes[q] for q in self.params_of[v] if self.refs[q, t] == 0)
        db = after - before
        tv, sv = self.p.time[v], self.p.saved[v]
        cs = self._cost(s, -tv, db if b == s else 0.0, dp_s, -sv)
        ct = self._cost(t, tv, db if b == t else 0.0, dp_t, sv)
        return cs, ct, db

    def apply(self, v: int, t: int) -> None:
        s = int(self.st[v])
        cs, ct, db = self.delta(v, t)
        b = min(s, t)
        self.bytes[b] += db
        for q in self.params_of[v]:
            self.refs[q, s] -= 1
            if self.refs[q, s] == 0:
                self.pmem[s] -= self.p.param_bytes[q]
            if self.refs[q, t] == 0:
                self.pmem[t] += self.p.param_bytes[q]
            self.refs[q, t] += 1
        self.time[s] -= self.p.time[v]
        self.time[t] += self.p.time[v]
        self.saved[s] -= self.p.saved[v]
        self.saved[t] += self.p.saved[v]
        self.count[s] -= 1
        self.count[t] += 1
        self.hcount[s] -= int(self.heavy[v])
        self.hcount[t] += int(self.heavy[v])
        self.st[v] = t
        self.cost[s], self.cost[t] = cs, ct


def refine(problem: DagProblem, obj: Objective, stage: np.ndarray,
           max_moves: int = 10_000) -> np.ndarray:
    """Return an assignment whose largest stage cost is no larger than ``stage``'s."""
    state = _State(problem, obj, stage)
    k = obj.num_stages
    members = [np.flatnonzero(state.st == t).tolist() for t in range(k)]
    for _ in range(max_moves):
        s = int(np.argmax(state.cost))
        old = state.cost[s]
        best: tuple[float, int, int] | None = None
        for t in (s - 1, s + 1):
            if not 0 <= t < k:
                continue
            for v in members[s]:
                if not state.movable(v, t):
                    continue
                cs, ct, _ = state.delta(v, t)
                score = max(cs, ct)
                if score < old * (1.0 - 1e-12) and (best is None or score < best[0]):
                    best = (score, v, t)
        if best is None:
            if not state.link_bound(s):
                break
            cut = cut_boundary(problem, obj, state.st, s, state.frozen, state.keep_heavy)
            if cut is None:
                break
            state = _State(problem, obj, cut, state.keep_heavy)
            members = [np.flatnonzero(state.st == t).tolist() for t in range(k)]
            continue
        _, v, t = best
        state.apply(v, t)
        members[s].remove(v)
        members[t].append(v)
        members[t].sort()
    return state.st.copy()
