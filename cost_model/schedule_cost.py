"""Closed-form step time, bubble and activations in flight of every pipeline schedule.

Why: the cluster planner prices hundreds of thousands of configurations, too many to run
the per-action simulator (``cost_model.simulate``) for each. On uniform stages at unit
costs ``price_schedule`` equals the simulator, which runs the executor's own action lists,
on every schedule and v (tests/cost_model/test_schedule_cost.py). The formulas, their
notation and where they are bounds: docs/planning.md "The closed form".
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
    else:
        t = m * s_max + fill * _bubble_share(name, p, m, v, ranks) + hops
    busy = m * sum(s)
    bubble = 1.0 - busy / (p * t) if t > 0 else 0.0
    return ScheduleCost(t, max(bubble, 0.0), in_flight_at(name, p, m, v, 0, a))


def in_flight_at(name: str, p: int, m: int, v: int, rank: int,
                 active: int | None = None) -> float:
    """Microbatches (through all of the rank's chunks) whose activations ``rank`` holds at
    its peak, a pending weight gradient's included (module docstring's table).

    >>> [in_flight_at("interleaved", 4, 8, 1, r) for r in range(4)]
    [4, 3, 2, 1]
    """
    a = p + 2 if active is None else active
    if name == "simple":
        return min(m, a)
    if name == "zbv":
        return min(2 * p, m + 1 + rank, 2 * m) / 2
    if name == "zero_bubble":
        return min(m, p)
    if v == 1:
        return min(m, p - rank)
    return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1) / v


def _bubble_share(name: str, p: int, m: int, v: int, ranks: Sequence[RankTimes]) -> float:
    """The 1F1B family's bubble over ``(p - 1) S`` on uniform stages of the ranks' mean
    times (module docstring's table), what ``fill`` is multiplied by."""
    if name == "interleaved":
        return 1.0 / v
    f = _mean(r.fwd_s for r in ranks)
    w = _mean(r.wgrad_s for r in ranks)
    i = max(_mean(r.bwd_s for r in ranks) - w, 0.0)
    d = min(w, f, i)
    if p == 1 or f + i + w <= 0:
        return 0.0
    if name == "zero_bubble":
        bubble = ((p - 1) * (f + i) - (min(m, p) - 1) * d) / v
    else:
        bubble = max((p - 1) * (f + i - d) / 2, (p - 1) * (f + i) - (m - 1) * min(f, (f + i) / 2))
    return bubble / ((p - 1) * (f + i + w))


def _mean(values: Iterable[float]) -> float:
    xs = list(values)
    return math.fsum(xs) / len(xs) if xs else 0.0


__all__ = ["SCHEDULES", "RankTimes", "ScheduleCost", "check", "in_flight_at", "price_schedule"]
