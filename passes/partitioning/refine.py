"""Local refinement of a stage assignment: move boundary nodes between adjacent stages.

The chain solve is exact for one order, but a DAG has many; moving boundary nodes keeps
the stages acyclic and can lower the largest stage cost. A link-bound stage falls back to
``mincut``. See docs/partitioning.md, 'The solver in detail'.
"""

from __future__ import annotations

import numpy as np

from passes.partitioning.mincut import cut_boundary
from passes.partitioning.problem import DagProblem, Objective, value_spans


class _State:
    """The assignment and its per-stage sums, updated move by move, in Python lists: per
    element numpy indexing costs several times more in these loops."""

    def __init__(self, problem: DagProblem, obj: Objective, stage: np.ndarray,
                 keep_heavy: bool | None = None) -> None:
        self.p, self.obj = problem, obj
        self.k = k = obj.num_stages
        st = np.array(stage, dtype=np.int64)
        self.st: list[int] = st.tolist()
        self.time: list[float] = np.bincount(st, weights=problem.time, minlength=k).tolist()
        self.saved: list[float] = np.bincount(st, weights=problem.saved,
                                              minlength=k).tolist()
        self.count: list[int] = np.bincount(st, minlength=k).tolist()
        heavy = problem.heavy()
        self.heavy: list[bool] = heavy.tolist()
        self.hcount: list[int] = np.bincount(st[heavy], minlength=k).tolist()
        # never take a stage's last heavy node, if every stage had one to begin with
        self.keep_heavy = all(self.hcount) if keep_heavy is None else keep_heavy
        self.succs = problem.succs()
        self.vals_of, self.params_of = problem._touching
        self.ntime: list[float] = problem.time.tolist()
        self.nsaved: list[float] = problem.saved.tolist()
        self.vbytes: list[float] = problem.val_bytes.tolist()
        self.pbytes: list[float] = problem.param_bytes.tolist()
        refs = np.zeros((len(problem.param_names), k), dtype=np.int64)
        rflat, rparam = problem._flat[5:]
        np.add.at(refs, (rparam, st[rflat]), 1)
        self.refs: list[dict[int, int]] = [{} for _ in problem.param_names]
        for q, s in zip(rparam.tolist(), st[rflat].tolist()):  # readers of q per stage
            self.refs[q][s] = self.refs[q].get(s, 0) + 1
        self.pmem: list[float] = ((problem.param_bytes[:, None] * (refs > 0)).sum(axis=0)
                                  if len(problem.param_names) else np.zeros(k)).tolist()
        self.out_stage = int(max((st[i] for i in problem.output_inputs), default=st.max()))
        self.frozen = set(problem.output_inputs) | {
            i for i, pin in enumerate(problem.pins) if pin >= 0}
        first, last = value_spans(problem, st)
        diff = np.zeros(k + 1)
        np.add.at(diff, first, problem.val_bytes)
        np.add.at(diff, last, -problem.val_bytes)
        self.bytes: list[float] = np.cumsum(diff)[:k].tolist()
        self.cost = np.array([self._cost(s) for s in range(k)])

    def stage(self) -> np.ndarray:
        return np.asarray(self.st, dtype=np.int64)

    def _span(self, v: int) -> tuple[int, int]:
        p, st = self.p, self.st
        cst = [st[c] for c in p.val_consumers[v]]
        prod = p.val_producer[v]
        first = st[prod] if prod >= 0 else min(cst, default=self.out_stage)
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
        st = self.st
        s = st[v]
        if v in self.frozen or self.count[s] <= 1:
            return False
        if self.keep_heavy and self.heavy[v] and self.hcount[s] <= 1:
            return False
        if t > s:
            return all(st[u] >= t for u in self.succs[v])
        return all(st[u] <= t for u in self.p.preds[v])

    def delta(self, v: int, t: int) -> tuple[float, float, float]:
        """(new cost of v's stage, new cost of t, boundary byte change) if v moved to t."""
        s = self.st[v]
        b = min(s, t)
        before = 0.0
        after = 0.0
        vbytes = self.vbytes
        for val in self.vals_of[v]:
            f, last = self._span(val)
            before += vbytes[val] * (f <= b < last)
        self.st[v] = t
        for val in self.vals_of[v]:
            f, last = self._span(val)
            after += vbytes[val] * (f <= b < last)
        self.st[v] = s
        refs, pbytes = self.refs, self.pbytes
        dp_s = -sum(pbytes[q] for q in self.params_of[v] if refs[q].get(s, 0) == 1)
        dp_t = sum(pbytes[q] for q in self.params_of[v] if refs[q].get(t, 0) == 0)
        db = after - before
        tv, sv = self.ntime[v], self.nsaved[v]
        cs = self._cost(s, -tv, db if b == s else 0.0, dp_s, -sv)
        ct = self._cost(t, tv, db if b == t else 0.0, dp_t, sv)
        return cs, ct, db

    def apply(self, v: int, t: int) -> None:
        s = self.st[v]
        cs, ct, db = self.delta(v, t)
        b = min(s, t)
        self.bytes[b] += db
        for q in self.params_of[v]:
            refs = self.refs[q]
            refs[s] -= 1
            if refs[s] == 0:
                self.pmem[s] -= self.pbytes[q]
                del refs[s]
            if t not in refs:
                self.pmem[t] += self.pbytes[q]
            refs[t] = refs.get(t, 0) + 1
        tv, sv = self.ntime[v], self.nsaved[v]
        self.time[s] -= tv
        self.time[t] += tv
        self.saved[s] -= sv
        self.saved[t] += sv
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
    members = [np.flatnonzero(np.asarray(stage) == t).tolist() for t in range(k)]
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
            cut = cut_boundary(problem, obj, state.stage(), s, state.frozen, state.keep_heavy)
            if cut is None:
                break
            state = _State(problem, obj, cut, state.keep_heavy)
            members = [np.flatnonzero(cut == t).tolist() for t in range(k)]
            continue
        _, v, t = best
        state.apply(v, t)
        members[s].remove(v)
        members[t].append(v)
        members[t].sort()
    return state.stage()
