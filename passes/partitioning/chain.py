"""Exact min-max partition of a chain into ``k`` contiguous, non-empty stages.

The cost of stage ``s`` covering positions ``[i, j)`` is

    cost(s, i, j) = W[j] - W[i] + inflight[s] * (S[j] - S[i]) + max(T[j] - T[i], comm[j])

with ``W``/``S``/``T`` prefix sums of the per-node stage-independent cost ``work``
(parameter memory), saved activation cost ``saved`` (scaled per stage by the microbatches
in flight) and compute ``time``, and ``comm[j]`` the link occupancy of what is live across
cut ``j`` (``comm[n] = tail_comm``, 0 unless the chain is the head of a longer one: the last
stage sends nothing). Compute and the send overlap (docs/architecture.md "Stage time
model"), hence the max; with no ``time`` the max is ``comm[j]`` and comm simply adds.

Exactness: with ``C_s = W + inflight[s] * S`` both arguments of the max and ``C_s`` are
non-decreasing in ``j - i``, so for a fixed end ``j`` the starts ``i`` that keep the stage
under a bottleneck ``B`` form a suffix ``i >= lo_s(j)``: ``cost <= B`` iff
``C_s[i] + T[i] >= C_s[j] + T[j] - B`` and ``C_s[i] >= C_s[j] + comm[j] - B``, each a
threshold on ``i`` (the suffix starts at the larger). So ``j`` is a feasible end iff the
latest reachable start before it is one of them, i.e. iff the cheapest stage ending at
``j`` costs <= ``B``. The feasibility of ``B`` is one vectorised sweep over stages,
restricted to the band of ends the previous stage can reach and the ends from which the
rest still fits in the remaining stages.

The bottleneck is found by parametric search: ``B`` is bisected between a lower bound and
the achieved maximum of the best partition found so far, which is always a real stage
cost. It stops when achieved max and largest infeasible ``B`` agree to ``rtol``, so the
result is optimal up to that tolerance (floating-point ties aside).

Example::

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
    """Cost of every stage of the partition given by ``cuts`` (direct sums, no prefixes).

    ``comm`` is indexed by cut (length ``n + 1``); ``comm[n]`` is ignored, the last stage
    pays ``tail_comm``.
    """
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
    ``tail[r]``: the latest end that leaves ``r`` required positions after it.

    Without ``heavy`` every position counts (plain non-empty stages): ``anchor[j] = j - 1``
    and ``tail[r] = n - r``. With it, only the ``heavy`` positions count.
    """
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

    When ``bound`` is infeasible it returns ``(None, t)``: no bound below ``t`` is feasible,
    because ``t`` is the least value at which any end rejected so far would be accepted
    (ends only ever get accepted as the bound grows). Probing ``t`` next often hits the
    optimum exactly. ``least`` is the prefix of node costs at their cheapest stage: what
    is left after an end ``j`` must fit in the remaining stages, which narrows the band.
    ``prefixes[s]`` is ``(C_s, C_s + T)``; a stage costs at least its ``C_s + T``
    difference, which bounds the band of ends from above.
    """
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
    """max(total / k, largest node), each node at its cheapest (least in-flight) stage.

    With ``comm`` (per cut, length n + 1) each of the ``k - 1`` sending stages costs at
    least the cheapest cut inside its max: the stage costs sum to at least
    ``sum(work + saved) + max(sum(time), (k - 1) * min comm)``, and stage 0 costs at least
    ``min comm``.
    """
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
    """Cut ``work`` into ``k`` contiguous non-empty stages minimising the largest stage cost.

    ``saved[i]`` is multiplied by ``inflight[s]`` on the stage ``s`` holding node ``i``;
    ``comm`` is per cut (length ``n - 1`` for cuts ``1..n-1``, or ``n + 1`` indexed by cut);
    ``time[i]`` is compute that overlaps the stage's send (the stage pays the larger of
    its summed ``time`` and ``comm`` at its end, module docstring); ``tail_comm`` is what
    the last stage sends (0 for a whole pipeline).
    ``pins[i] >= 0`` forces node ``i`` onto that stage. ``heavy`` marks the positions that
    do real work: every stage then holds at least one of them, unless there are fewer than
    ``k`` or the pins leave no room for it (then stages need only be non-empty). Raises
    ``SMPPartitionError`` when ``k > n`` or the pins cannot be honoured by contiguous stages.
    """
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

    Min-max alone is indifferent to every stage but the costliest: with a latency-bound or
    one-huge-node bottleneck it may leave the other stages nearly empty. This keeps the
    optimal bottleneck stage of ``solve`` fixed and re-solves the sub-chains on either side
    of it with their own stage counts, recursively, so the second-largest cost is minimised
    next, and so on. The result is kept only if its sorted (descending) cost vector is
    lexicographically no larger than ``solve``'s, so the bottleneck never gets worse.
    ``first`` is ``solve``'s result for the same arguments when the caller already has it.
    """
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
