"""Closed-form step time, bubble and activations in flight of every pipeline schedule.

Why: the cluster planner prices hundreds of thousands of configurations; running the
per-action simulator (``cost_model.simulate``) for each is too slow, and the simulator
does not have the virtual-stage and zero-bubble schedules yet. ``price_schedule`` is the
one function the planner calls. Its formulas equal the simulator on the schedules the
simulator has (``simple`` and ``interleaved`` at v = 1, tests/cost_model/
test_schedule_cost.py) on uniform stages, every action and transfer included.

Notation: ``p`` ranks, ``m`` microbatches, ``v`` chunks (virtual stages) per rank; per
rank and microbatch, over all its chunks, ``f`` forward, ``b`` backward (the recompute
forward included, when there is one), ``w`` the part of ``b`` that computes weight
gradients (what a zero-bubble schedule defers), ``S = f + b``. Stages may differ (the
first holds the embedding, the last the head): ``S_max`` is the slowest rank's and
``fill = sum(S) - S_max`` the others' (``(p - 1) S`` for uniform stages). ``hop`` is one
point-to-point transfer (link time + latency). GPipe waits for ``2 (p - 1)`` of them per
wave (fill and drain); the 1F1B family also in its steady state, where stage 0 runs ``p``
microbatches per round trip of one: ``max(2 (p - 1), 2 (p - 1) m / p + 2 (p - 2))`` hops,
the simulator's count when m is a multiple of p (within two hops otherwise; tests).

====================  ===========================================  ======================
schedule              step time (uniform stages)                   in flight, rank 0
====================  ===========================================  ======================
simple, v = 1         sum over waves of k = min(a, left) micro-    min(m, a)
(GPipe)               batches: (k + p - 1) S + 2 (p - 1) hop
interleaved, v = 1    (m + p - 1) S + hops                         min(m, p)
(1F1B)
interleaved, v > 1    (m + (p - 1) / v) S + hops                   min(m v, 2 (p - 1) +
(Megatron, [1])                                                    (v - 1) p + 1) / v
simple, v > 1         ((v - 1) max(m, p) + m + p - 1) S / v        min(m, a)
(looped BFS, [3])     + 2 (p - 1) hop
zero_bubble, v = 1    m S + (p - 1)(f + b - 2 w) + hops            min(m, p)
(ZB-H1, [2])
zero_bubble, v > 1    m S + (p - 1)(f + b - 2 w) / v + ...         as interleaved
zbv, v = 2 ([2])      m S + (p - 1)(f + b - 3 w) / 2 + ...         min(m, p)
====================  ===========================================  ======================

``a`` is ``active_microbatches`` (SMP's default p + 2): ``simple`` runs fill-drain waves of
that many. On stages that differ, ``(p - 1) S`` becomes ``fill`` and ``m S`` becomes
``m S_max``; for ``simple`` each wave is ``sum(f) + (k - 1) max(f) + sum(b) + (k - 1)
max(b)`` (a flow shop of identical jobs: exact); for 1F1B the form is exact on uniform
stages and an upper bound otherwise (6.5 % at most on stages within 10 % of each other).

[1] Narayanan et al., SC'21, arXiv 2104.04473, section 2.2.2: bubble (p - 1) / (v m);
    Megatron's warm-up of 2 (p - 1) + (v - 1) p chunk-microbatches on rank 0; m a
    multiple of p. [2] Qi et al., ICLR 2024, arXiv 2401.10241: ZB-H1's bubble is
    (p - 1)(T_F + T_B - T_W) with T_B the input gradient (here b - w) at 1F1B's memory;
    ZB-V runs two chunks per rank in a V at 1F1B's memory, each chunk a ZB-H2-like
    (p - 1)(T_F + T_B - 2 T_W) of half-size passes. [3] Lamy-Poirier, arXiv 2211.05953:
    looped BFS, bubble (p - 1) / (v m) when m >= p, every microbatch of every chunk held.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cost_model.errors import ScheduleError

SCHEDULES = ("simple", "interleaved", "zero_bubble", "zbv")
"""Every schedule the planner prices (``pipeline`` values; ``zero_bubble`` and ``zbv`` as
issue 27 names them)."""


@dataclass(frozen=True)
class RankTimes:
    """One rank's seconds per microbatch, its chunks together (module docstring)."""

    fwd_s: float
    bwd_s: float
    wgrad_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True)
class ScheduleCost:
    """What a schedule costs: the pipeline's makespan, its bubble (idle share of
    ``p x makespan``) and the microbatches whose activations rank 0 holds at its peak (in
    units of one microbatch through all of that rank's chunks)."""

    pipeline_s: float
    bubble_fraction: float
    in_flight: float


def check(name: str, p: int, m: int, v: int) -> str | None:
    """Why a (schedule, p, m, v) cannot run, or None (the constraints the formulas assume,
    as the schedules' generators impose them)."""
    if name not in SCHEDULES:
        return f"schedule {name!r} is not one of {SCHEDULES}"
    if min(p, m, v) < 1:
        return "p, m and v must be >= 1"
    if name == "zbv" and v != 2:
        return "zbv runs exactly two chunks per rank (v = 2)"
    if v > 1 and name in ("interleaved", "zero_bubble") and (m < p or m % p):
        return f"interleaved chunks need microbatches a multiple of p (m = {m}, p = {p})"
    if v > 1 and p == 1:
        return "virtual stages need a pipeline (p > 1)"
    return None


def price_schedule(name: str, ranks: Sequence[RankTimes], m: int, v: int = 1, *,
                   active: int | None = None, hop_s: float = 0.0) -> ScheduleCost:
    """Makespan, bubble and rank 0's activations in flight of schedule ``name`` (module
    docstring) for ``len(ranks)`` ranks and ``m`` microbatches.

    >>> r = price_schedule("interleaved", [RankTimes(1.0, 2.0)] * 4, 8)
    >>> r.pipeline_s, round(r.bubble_fraction, 4), r.in_flight
    (33.0, 0.2727, 4)
    >>> price_schedule("interleaved", [RankTimes(1.0, 2.0)] * 4, 8, v=2).pipeline_s
    28.5
    """
    p = len(ranks)
    why = check(name, p, m, v)
    if why is not None:
        raise ScheduleError.build("a schedule the formulas cover", why,
                                  "cost_model.schedule_cost.price_schedule",
                                  "pick another schedule, v or microbatch count")
    a = p + 2 if active is None else active
    s = [r.total_s for r in ranks]
    s_max, fill = max(s), sum(s) - max(s)
    hops = hop_s * max(2 * (p - 1), 2 * (p - 1) * m / p + 2 * (p - 2))
    if name == "simple":
        waves = [min(a, m - start) for start in range(0, m, a)]
        if v == 1:
            fs, bs = [r.fwd_s for r in ranks], [r.bwd_s for r in ranks]
            t = sum(sum(fs) + (k - 1) * max(fs) + sum(bs) + (k - 1) * max(bs) for k in waves)
        else:  # looped BFS: v loops of the p ranks per wave
            t = sum(((v - 1) * max(k, p) + k - 1) * s_max / v + sum(s) / v for k in waves)
        t += 2 * (p - 1) * hop_s * len(waves)
    elif name == "interleaved":
        t = m * s_max + fill / v + hops
    else:
        f = _mean(r.fwd_s for r in ranks)
        b = _mean(r.bwd_s for r in ranks)
        w = _mean(r.wgrad_s for r in ranks)
        share = (f + b - (3 if name == "zbv" else 2) * w) / (f + b) if f + b > 0 else 0.0
        t = m * s_max + fill * max(share, 0.0) / v + hops
    busy = m * sum(s)
    bubble = 1.0 - busy / (p * t) if t > 0 else 0.0
    return ScheduleCost(t, max(bubble, 0.0), in_flight_at(name, p, m, v, 0, a))


def in_flight_at(name: str, p: int, m: int, v: int, rank: int,
                 active: int | None = None) -> float:
    """Microbatches (through all of the rank's chunks) whose activations ``rank`` holds at
    its peak: ``simple`` every one of a wave; 1F1B and ZB-H1 ``min(m, p - rank)``;
    Megatron's interleaving ``2 (p - rank - 1) + (v - 1) p + 1`` chunk-microbatches; ZB-V
    the same on every rank (Qi et al.: its chunks balance memory), ``min(m, p)``.

    >>> [in_flight_at("interleaved", 4, 8, 1, r) for r in range(4)]
    [4, 3, 2, 1]
    """
    a = p + 2 if active is None else active
    if name == "simple":
        return min(m, a)
    if name == "zbv":
        return min(m, p)
    if v == 1:
        return min(m, p - rank)
    return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v


def _mean(values: Iterable[float]) -> float:
    xs = list(values)
    return math.fsum(xs) / len(xs) if xs else 0.0


__all__ = ["SCHEDULES", "RankTimes", "ScheduleCost", "check", "in_flight_at", "price_schedule"]
