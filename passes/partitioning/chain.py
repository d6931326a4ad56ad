"""Exact min-max partition of a chain into ``k`` contiguous, non-empty stages.

For a fixed stage end the feasible starts under a bottleneck form a suffix, so checking a
bottleneck is one vectorised sweep and a parametric search finds the optimum to ``rtol``.
See docs/partitioning.md, 'The solver in detail'.

>>> solve([1.0, 1.0, 1.0, 1.0], 2).cuts
(2,)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cost_model.errors import SMPPartitionError

FloatArray = np.ndarray
#: What the solvers accept per node: a list or an array (converted once, by ``_prepare``).
Values = Sequence[float] | np.ndarray
Ints = Sequence[int] | np.ndarray
Flags = Sequence[bool] | np.ndarray


@dataclass(frozen=True)
class ChainSolution:
    """``cuts[s]`` is the first position of stage ``s + 1``; stage costs in input units."""

    cuts: tuple[int, ...]
    bottleneck: float
    stage_costs: tuple[float, ...]

    def stages(self, n: int) -> np.ndarray:
        """Stage index of each of the ``n`` positions."""
        out = np.zeros(n, dtype=np.int64)
        for c in self.cuts:
            out[c:] += 1
        return out


@dataclass(frozen=True)
class _Band:
    start: int          # first end position covered by ``last_reach``
    last_reach: FloatArray  # latest reachable end <= start + t, for t = 0.. (-1: none)


def stage_costs(cuts: Sequence[int], work: FloatArray, saved: FloatArray, comm: FloatArray,
                inflight: FloatArray, time: FloatArray | None = None,
                tail_comm: float = 0.0) -> np.ndarray:
    """Cost of every stage of the partition given by ``cuts`` (direct sums, no prefixes)."""
    work, saved = np.asarray(work, dtype=np.float64), np.asarray(saved, dtype=np.float64)
    n = len(work)
    tm = np.zeros(n) if time is None else np.asarray(time, dtype=np.float64)
    bounds = [0, *cuts, n]
    out = np.empty(len(bounds) - 1)
    for s in range(len(bounds) - 1):
        i, j = bounds[s], bounds[s + 1]
        c = comm[j] if j < n else tail_comm
        out[s] = (float(work[i:j].sum()) + inflight[s] * float(saved[i:j].sum())
                  + max(float(tm[i:j].sum()), float(c)))
    return out


def _prepare(work: Values, k: int, saved: Values | None,
             comm: Values | None, inflight: Values | None,
             pins: Ints | None, time: Values | None = None,
             tail_comm: float = 0.0) -> tuple[FloatArray, ...]:
    w = np.asarray(work, dtype=np.float64)
    n = len(w)
    tm = np.zeros(n) if time is None else np.asarray(time, dtype=np.float64)
    sv = np.zeros(n) if saved is None else np.asarray(saved, dtype=np.float64)
    cm = np.zeros(n + 1) if comm is None else np.asarray(comm, dtype=np.float64)
    if len(cm) == n - 1:  # comm given per internal cut 1..n-1
        cm = np.concatenate([[0.0], cm, [0.0]])
    infl = np.ones(k) if inflight is None else np.asarray(inflight, dtype=np.float64)
    pn = np.full(n, -1, dtype=np.int64) if pins is None else np.asarray(pins, dtype=np.int64)
    if k < 1 or k > n:
        raise SMPPartitionError.build(
            "a chain of n nodes can be cut into at most n non-empty stages", f"n={n}, k={k}",
            "chain.solve", "ask for fewer partitions or give a finer-grained graph")
    if len(sv) != n or len(tm) != n or len(cm) != n + 1 or len(infl) != k or len(pn) != n:
        raise SMPPartitionError.build(
            "saved/time/pins need n entries, comm n-1 or n+1, inflight k",
            (len(sv), len(tm), len(cm), len(infl), len(pn)), "chain.solve",
            f"pass arrays sized for n={n}, k={k}")
    for name, arr in (("work", w), ("time", tm), ("saved", sv), ("comm", cm),
                      ("inflight", infl), ("tail_comm", np.array([tail_comm]))):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
        if bad.size:
            raise SMPPartitionError.build(
                f"chain {name} costs must be finite and >= 0",
                f"{arr[bad[0]]} at position {bad[0]}", "chain.solve",
                "check the node costs (passes.annotate_costs)")
    if np.any(pn >= k):
        raise SMPPartitionError.build("a pin names a stage >= k", int(pn.max()),
                                      f"chain.solve, position {int(np.argmax(pn))}",
                                      f"pin to stages below {k}")
    cm = cm.copy()
    cm[n] = tail_comm
    return w, sv, cm, infl, pn, tm


def _pin_windows(pins: FloatArray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Ends ``j`` allowed for stage ``s``: every pin before ``j`` <= s, every pin after > s."""
    n = len(pins)
    maxpre = np.concatenate([[-1], np.maximum.accumulate(pins)])  # max pin in [0, j)
    big = np.where(pins < 0, k, pins)
    minsuf = np.concatenate([np.minimum.accumulate(big[::-1])[::-1], [k]])  # min pin in [j, n)
    stages = np.arange(k)
    j1 = np.searchsorted(maxpre, stages, side="right") - 1  # last j with maxpre[j] <= s
    j0 = np.searchsorted(minsuf, stages, side="right")      # first j with minsuf[j] > s
    return j0, np.minimum(j1, n)


def _anchors(heavy: np.ndarray | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``anchor[j]``: the last position < ``j`` a stage ending at ``j`` must hold (-1: none);
    ``tail[r]``: the latest end that leaves ``r`` required (``heavy``) positions after it."""
    if heavy is None:
        return np.arange(-1, n, dtype=np.int64), np.arange(n, -1, -1, dtype=np.int64)
    pos = np.flatnonzero(heavy)
    marks = np.where(heavy, np.arange(n), -1)
    anchor = np.concatenate([[-1], np.maximum.accumulate(marks)]).astype(np.int64)
    tail = np.concatenate([[n], pos[::-1]]).astype(np.int64)
    return anchor, tail


def _check(bound: float, prefixes: list[tuple[FloatArray, FloatArray]], tp: FloatArray,
           comm: FloatArray, k: int, j0: np.ndarray, j1: np.ndarray, least: FloatArray,
           anchors: tuple[np.ndarray, np.ndarray]
           ) -> tuple[list[_Band] | None, float]:
    """Bands of reachable stage ends if every stage can stay <= ``bound``.

    Infeasible: ``(None, t)``, ``t`` the least bound at which a rejected end would pass
    (probing it next often hits the optimum exactly)."""
    n = len(comm) - 1
    bands: list[_Band] = [_Band(0, np.zeros(1, dtype=np.int64))]
    first, last = 0, 0
    nxt = np.inf
    for s in range(k):
        cs, full = prefixes[s]
        left = k - 1 - s
        lo = max(first + 1, int(j0[s]), n if s == k - 1 else 0)
        if left:
            scale = left * (1.0 + 1e-12)
            lo_rest = int(least.searchsorted(least[n] - scale * bound, side="left"))
            if lo_rest > lo:
                lo = lo_rest
                nxt = min(nxt, float(least[n] - least[lo - 1]) / scale)
        hi = min(int(anchors[1][left]), int(j1[s]))
        hi_cost = int(full.searchsorted(full[last] + bound, side="right")) - 1
        if hi_cost < hi:
            hi = hi_cost
            nxt = min(nxt, float(full[hi + 1] - full[last]))
        if lo > hi:
            return None, nxt
        js = np.arange(lo, hi + 1)
        prev = bands[-1]
        idx = np.minimum(anchors[0][js] - prev.start, len(prev.last_reach) - 1)
        # latest reachable start keeping the anchor: the cheapest stage ending at j
        start = np.where(idx >= 0, prev.last_reach[np.maximum(idx, 0)], -1)
        st0 = np.maximum(start, 0)
        cost = cs[js] - cs[st0] + np.maximum(tp[js] - tp[st0], comm[js])
        ok = (cost <= bound) & (start >= 0)
        over = cost[(~ok) & (start >= 0)]
        if over.size:
            nxt = min(nxt, float(over.min()))
        if not ok.any():
            return None, nxt
        pos = np.where(ok, js, -1)
        bands.append(_Band(lo, np.maximum.accumulate(pos)))
        first, last = lo + int(ok.argmax()), lo + len(ok) - 1 - int(ok[::-1].argmax())
    return bands, nxt


def _backtrack(bands: list[_Band], n: int, k: int, anchor: np.ndarray) -> tuple[int, ...]:
    cuts = []
    j = n
    for s in range(k - 1, 0, -1):
        prev = bands[s]  # band of stage s - 1 ends
        j = int(prev.last_reach[min(int(anchor[j]) - prev.start, len(prev.last_reach) - 1)])
        cuts.append(j)
    return tuple(reversed(cuts))


def lower_bound(work: Values, k: int, saved: Values | None = None,
                inflight: Values | None = None,
                comm: Values | None = None,
                time: Values | None = None) -> float:
    """max(total / k, largest node), each node at its cheapest stage; with ``comm`` each of the
    ``k - 1`` sending stages pays at least the cheapest cut."""
    w = np.asarray(work, dtype=np.float64)
    tm = np.zeros(len(w)) if time is None else np.asarray(time, dtype=np.float64)
    sv = np.zeros(len(w)) if saved is None else np.asarray(saved, dtype=np.float64)
    least = 1.0 if inflight is None else float(np.min(inflight))
    node = w + least * sv + tm
    cheapest = 0.0
    if comm is not None and k > 1 and len(w) > 1:
        cheapest = float(np.min(np.asarray(comm, dtype=np.float64)[1:len(w)]))
    total = float(np.sum(w + least * sv)) + max(float(tm.sum()), (k - 1) * cheapest)
    return float(max(total / k, node.max(initial=0.0), cheapest))


def solve(work: Values, k: int, *, saved: Values | None = None,
          comm: Values | None = None, inflight: Values | None = None,
          pins: Ints | None = None, heavy: Flags | None = None,
          time: Values | None = None, tail_comm: float = 0.0,
          rtol: float = 1e-9) -> ChainSolution:
    """Cut a chain into ``k`` contiguous non-empty stages minimising the largest stage cost.

    ``pins[i] >= 0`` forces node ``i``'s stage; with ``heavy`` every stage holds one where
    possible. ``SMPPartitionError`` when ``k > n`` or the pins cannot be honoured."""
    w, sv, cm, infl, pn, tm = _prepare(work, k, saved, comm, inflight, pins, time, tail_comm)
    n = len(w)
    hv = None if heavy is None else np.asarray(heavy, dtype=bool)
    if hv is not None and len(hv) != n:
        raise SMPPartitionError.build("heavy needs one flag per node", len(hv),
                                      "chain.solve", f"pass n={n} flags")
    if hv is not None and int(hv.sum()) < k:
        hv = None
    anchors = _anchors(hv, n)
    wp = np.concatenate([[0.0], np.cumsum(w)])
    sp = np.concatenate([[0.0], np.cumsum(sv)])
    tp = np.concatenate([[0.0], np.cumsum(tm)])
    cache: dict[float, tuple[FloatArray, FloatArray]] = {}
    for f in infl:
        if float(f) not in cache:
            cs = wp + float(f) * sp
            cache[float(f)] = (cs, cs + tp)
    prefixes = [cache[float(f)] for f in infl]
    j0, j1 = _pin_windows(pn, k)
    least = wp + float(infl.min()) * sp + tp

    def achieved(cuts: tuple[int, ...]) -> float:
        return float(stage_costs(cuts, w, sv, cm, infl, tm, cm[n]).max())

    def check(bound: float, anchors: tuple[np.ndarray, np.ndarray]
              ) -> tuple[list[_Band] | None, float]:
        return _check(bound, prefixes, tp, cm, k, j0, j1, least, anchors)

    lo = lower_bound(w, k, sv, infl, cm, tm) * (1.0 - 1e-12)  # a lower bound on the optimum
    if np.any(pn >= 0):
        top = float(max(p[1][-1] for p in prefixes) + cm.max()) * 2.0 + 1.0
        if hv is not None and check(top, anchors)[0] is None:
            anchors = _anchors(None, n)  # the pins win over the work-on-every-stage wish
        if check(top, anchors)[0] is None:
            raise SMPPartitionError.build(
                "the pinned nodes cannot be kept on their stages with contiguous stages",
                f"pins at positions {np.flatnonzero(pn >= 0)[:8].tolist()}",
                f"chain.solve into {k} stages",
                "pin in execution order (earlier modules on lower stages), leaving every "
                "stage a node of its own")
    best: tuple[int, ...] | None = None
    value = np.inf
    excess = 0.5 * rtol  # gallop up from the lower bound: optima are often within a hair
    probe = max(lo, 1e-300) * (1.0 + excess)
    threshold_next = False
    for _ in range(400):
        bands, nxt = check(probe, anchors)
        if bands is not None:
            cand = _backtrack(bands, n, k, anchors[0])
            cval = achieved(cand)
            if cval < value:
                best, value = cand, cval
            else:  # rounding: the sweep accepted the probe, the direct sums disagree
                lo = max(lo, probe)
            threshold_next = False
        else:
            lo = max(lo, probe, nxt * (1.0 - 4e-16) if np.isfinite(nxt) else probe)
            threshold_next = not threshold_next and bool(np.isfinite(nxt))
        if best is not None and value - lo <= rtol * value:
            break
        if threshold_next and nxt < value:
            probe = nxt  # the next value at which anything changes: maybe the optimum
        elif best is None:
            excess = min(excess * 16.0, 0.5) if excess < 0.5 else excess * 2.0
            probe = max(lo, 1e-300) * (1.0 + excess)
        else:
            probe = 0.5 * (lo + value)
    assert best is not None
    costs = stage_costs(best, w, sv, cm, infl, tm, cm[n])
    return ChainSolution(best, float(costs.max()), tuple(float(c) for c in costs))


def solve_lex(work: Values, k: int, *, saved: Values | None = None,
              comm: Values | None = None, inflight: Values | None = None,
              pins: Ints | None = None, heavy: Flags | None = None,
              time: Values | None = None, rtol: float = 1e-9,
              first: ChainSolution | None = None) -> ChainSolution:
    """``solve``, then balance the stages the bottleneck leaves free (lexicographic min-max).

    Kept only if its sorted costs are no larger, so the bottleneck never gets worse."""
    w, sv, cm, infl, pn, tm = _prepare(work, k, saved, comm, inflight, pins, time)
    n = len(w)
    hv = None if heavy is None else np.asarray(heavy, dtype=bool)
    if first is None:
        first = solve(w, k, saved=sv, comm=cm, inflight=infl, pins=pn, heavy=hv, time=tm,
                      rtol=rtol)

    def sub(lo: int, hi: int, s0: int, s1: int, sol: ChainSolution | None) -> list[int]:
        """Cuts inside ``[lo, hi)`` for stages ``s0..s1-1`` (the last pays comm[hi])."""
        m = s1 - s0
        if m == 1:
            return []
        if sol is None:
            sc = cm[lo:hi + 1].copy()
            sp = np.where(pn[lo:hi] >= 0, pn[lo:hi] - s0, -1)
            sol = solve(w[lo:hi], m, saved=sv[lo:hi], comm=sc, inflight=infl[s0:s1], pins=sp,
                        heavy=None if hv is None else hv[lo:hi], time=tm[lo:hi],
                        tail_comm=float(cm[hi]), rtol=rtol)
        b = int(np.argmax(sol.stage_costs))
        bounds = [0, *sol.cuts, hi - lo]
        i, j = lo + bounds[b], lo + bounds[b + 1]
        left = [*sub(lo, i, s0, s0 + b, None), i] if b > 0 else []
        right = [j, *sub(j, hi, s0 + b + 1, s1, None)] if b < m - 1 else []
        return left + right

    cuts = tuple(sub(0, n, 0, k, first))
    costs = stage_costs(cuts, w, sv, cm, infl, tm)
    if lex_key(costs) <= lex_key(np.asarray(first.stage_costs)):
        return ChainSolution(cuts, float(costs.max()), tuple(float(c) for c in costs))
    return first


def lex_key(costs: np.ndarray) -> tuple[float, ...]:
    """Stage costs sorted descending: compare two plans lexicographically by this."""
    return tuple(float(c) for c in np.sort(np.asarray(costs, dtype=np.float64))[::-1])
