"""Run a schedule's action lists on the cost model: predicted step time, memory, timeline.

The simulator interprets the same ``cost_model.schedule`` tuples the runtime executor runs:
one list per rank, actions naming their chunk (``cost_model.actions``). It is event
driven: an action starts when its rank is free and its input has arrived. Timing model
(documented because plans quote its numbers), with one ``StageCost`` per chunk:

- F(c, mb) takes ``fwd_time_s`` of chunk c; B(c, mb) ``bwd_time_s``; a split backward
  takes ``bwd_time_s - wgrad_time_s`` for I and ``wgrad_time_s`` for W.
- F(c, mb)'s input is F(c-1, mb)'s boundary output. Between chunks on two ranks it is
  sent over the link between them: it occupies the link for ``send_fwd_s`` of chunk c-1
  and arrives ``latency_s`` later; the input gradient of chunk c (from its B or I) goes
  back likewise in ``send_bwd_s`` of chunk c. Between chunks on one rank it is handed
  over at once. A transfer does not occupy the sender's compute (asynchronous send), but
  transfers from one rank to another go one at a time, in the sender's order; latency
  delays arrival without keeping the link busy (architecture.md "Stage time model").
- Fixed costs: every action also takes ``action_overhead_s`` plus ``message_overhead_s``
  per message its rank receives or sends for it (a neighbour chunk on another rank).
- Memory of rank r = the ``static_bytes`` of its chunks + what its chunks keep for
  backward, at the peak over its list: a forward adds ``saved_bytes_per_mb``, an input
  gradient leaves ``wgrad_saved_bytes_per_mb`` (what a pending W holds), the W or a full B
  releases it all. A forward-only schedule keeps nothing.
- ``bubble_fraction`` = 1 - (sum of busy time) / (ranks x makespan): the idle share of one
  step. ``bubble_rate`` is the papers' convention: with steps back to back and no barrier
  between them, a rank repeats every ``max_r (last end_r - first start_r)``; the rate is
  that period over the busiest rank's work, minus 1 ((p - 1) / m for GPipe and 1F1B).

p=2, m=2, simple, fwd 1, bwd 2, no transfer time: rank 1 runs F0 [1,2] F1 [2,3]
B0 [3,5] B1 [5,7]; rank 0 runs B0 [5,7] B1 [7,9]; step 9, bubble 1 - 12/18 = 1/3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cost_model.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Token,
    gives,
    needs,
    placement_of,
)
from cost_model.errors import ScheduleError
from cost_model.schedule_check import in_flight


@dataclass(frozen=True)
class StageCost:
    """What one microbatch costs on one chunk (virtual stage), as the simulator needs it.

    ``wgrad_time_s`` is the weight-gradient part of ``bwd_time_s`` (what a W takes; I takes
    the rest). ``wgrad_saved_bytes_per_mb`` is what a microbatch holds from its I to its W
    (None: what its forward saved); it may exceed that (the I's own products kept for W).
    """

    fwd_time_s: float
    bwd_time_s: float
    send_fwd_s: float = 0.0
    send_bwd_s: float = 0.0
    static_bytes: int = 0
    saved_bytes_per_mb: int = 0
    latency_s: float = 0.0
    action_overhead_s: float = 0.0
    message_overhead_s: float = 0.0
    wgrad_time_s: float = 0.0
    wgrad_saved_bytes_per_mb: int | None = None

    def work_s(self, kind: str) -> float:
        """Seconds of compute in one action of ``kind``."""
        if kind == FORWARD:
            return self.fwd_time_s
        if kind == BACKWARD:
            return self.bwd_time_s
        if kind == INPUT_GRAD:
            return max(self.bwd_time_s - self.wgrad_time_s, 0.0)
        return self.wgrad_time_s

    def duration(self, kind: str, messages: int) -> float:
        """Seconds a rank is busy for one action of ``kind`` with ``messages`` in or out."""
        return self.work_s(kind) + self.action_overhead_s + messages * self.message_overhead_s

    @property
    def pending_w_bytes(self) -> int:
        """Bytes a microbatch keeps between its I and its W."""
        if self.wgrad_saved_bytes_per_mb is None:
            return self.saved_bytes_per_mb
        return self.wgrad_saved_bytes_per_mb

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageCost:
        return cls(**data)


@dataclass(frozen=True)
class TimelineEvent:
    """One executed action: ``rank`` ran ``action`` from ``start_s`` to ``end_s``."""

    rank: int
    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """Prediction for one training step (all microbatches) of a schedule; per-rank tuples."""

    step_time_s: float
    bubble_fraction: float
    busy_s: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_memory_bytes: tuple[int, ...]
    timeline: tuple[TimelineEvent, ...]
    bubble_rate: float = 0.0

    def finish_times(self) -> tuple[float, ...]:
        """When each rank ends its last action (0 for a rank with none)."""
        ends = [0.0] * len(self.busy_s)
        for e in self.timeline:
            ends[e.rank] = max(ends[e.rank], e.end_s)
        return tuple(ends)

    def chrome_trace(self) -> list[dict[str, Any]]:
        """Events for chrome://tracing / Perfetto (one thread per rank, microseconds)."""
        names = {FORWARD: "forward", BACKWARD: "backward", INPUT_GRAD: "input gradient",
                 WEIGHT_GRAD: "weight gradient"}
        return [{"name": str(e.action), "ph": "X", "pid": 0, "tid": e.rank,
                 "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
                 "cat": names[e.action.kind],
                 "args": {"chunk": e.action.stage, "microbatch": e.action.microbatch}}
                for e in self.timeline]


def _messages(action: Action, rank_of: Sequence[int]) -> int:
    """Messages a rank receives and sends for ``action``: one per neighbour chunk that
    exchanges a value with it and sits on another rank."""
    if action.kind == WEIGHT_GRAD:
        return 0
    c, rank = action.stage, rank_of[action.stage]
    before = c > 0 and rank_of[c - 1] != rank
    after = c < len(rank_of) - 1 and rank_of[c + 1] != rank
    return int(before) + int(after)


def _memory_peak(actions: Sequence[Action], costs: Sequence[StageCost]) -> int:
    held = peak = 0
    for a in actions:
        cost = costs[a.stage]
        if a.kind == FORWARD:
            held += cost.saved_bytes_per_mb
        elif a.kind == BACKWARD:
            held -= cost.saved_bytes_per_mb
        elif a.kind == INPUT_GRAD:
            held -= cost.saved_bytes_per_mb - cost.pending_w_bytes
        else:
            held -= cost.pending_w_bytes
        peak = max(peak, held)
    return peak


def simulate(schedule: Sequence[Sequence[Action]],
             stage_costs: Sequence[StageCost]) -> SimResult:
    """Predict the step time, memory and timeline of ``schedule`` under ``stage_costs``
    (one per chunk).

    >>> from cost_model.schedule import generate
    >>> r = simulate(generate("simple", 2, 2), [StageCost(1.0, 2.0)] * 2)
    >>> r.step_time_s, round(r.bubble_fraction, 4)
    (9.0, 0.3333)
    """
    p = len(schedule)
    rank_of = placement_of(schedule)
    n = len(rank_of)
    if len(stage_costs) != n:
        raise ScheduleError.build("simulate needs one StageCost per chunk", len(stage_costs),
                                  f"schedule with {n} chunks", "pass one cost per chunk")
    arrival: dict[tuple[Token, int], float] = {}  # when a token reaches a rank
    link_free: dict[tuple[int, int], float] = {}
    rank_free = [0.0] * p
    cursor = [0] * p
    events: list[TimelineEvent] = []
    remaining = sum(len(s) for s in schedule)
    while remaining:
        progressed = False
        for r in range(p):
            while cursor[r] < len(schedule[r]):
                action = schedule[r][cursor[r]]
                need = needs(action, n)
                if need is not None and (need, r) not in arrival:
                    break
                start = max(rank_free[r], arrival[need, r] if need is not None else 0.0)
                cost = stage_costs[action.stage]
                end = start + cost.duration(action.kind, _messages(action, rank_of))
                events.append(TimelineEvent(r, action, start, end))
                rank_free[r] = end
                cursor[r] += 1
                remaining -= 1
                progressed = True
                token = gives(action)
                if token is None:
                    continue
                arrival[token, r] = end  # read on this rank (the next chunk, or its own W)
                to = action.stage + 1 if action.kind == FORWARD else action.stage - 1
                if 0 <= to < n and rank_of[to] != r:
                    send = cost.send_fwd_s if action.kind == FORWARD else cost.send_bwd_s
                    link = (r, rank_of[to])
                    send_start = max(end, link_free.get(link, 0.0))
                    link_free[link] = send_start + send
                    arrival[token, rank_of[to]] = send_start + send + cost.latency_s
        if not progressed:
            stuck = ", ".join(f"rank {r} at {schedule[r][cursor[r]]}" for r in range(p)
                              if cursor[r] < len(schedule[r]))
            raise ScheduleError.build("the schedule deadlocks in simulation", stuck,
                                      "cost_model.simulate", "check it with schedule.validate")
    return _result(schedule, stage_costs, events)


def _result(schedule: Sequence[Sequence[Action]], stage_costs: Sequence[StageCost],
            events: list[TimelineEvent]) -> SimResult:
    p = len(schedule)
    makespan = max((e.end_s for e in events), default=0.0)
    busy = tuple(sum(e.end_s - e.start_s for e in events if e.rank == r) for r in range(p))
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    spans = [max((e.end_s for e in events if e.rank == r), default=0.0)
             - min((e.start_s for e in events if e.rank == r), default=0.0) for r in range(p)]
    rate = max(spans) / max(busy) - 1.0 if max(busy, default=0.0) > 0 else 0.0
    # forward-only (evaluation) schedules save nothing for backward: nothing is in flight
    training = any(a.kind != FORWARD for actions in schedule for a in actions)
    peaks = tuple(max([0] + in_flight(schedule[r])) if training else 0 for r in range(p))
    memory = tuple(
        sum(stage_costs[c].static_bytes for c in {a.stage for a in schedule[r]})
        + (_memory_peak(schedule[r], stage_costs) if training else 0) for r in range(p))
    events.sort(key=lambda e: (e.start_s, e.rank))
    return SimResult(makespan, bubble, busy, peaks, memory, tuple(events), max(rate, 0.0))


def training_step_s(sim: SimResult, after_s: Sequence[float],
                    reductions: Sequence[tuple[Sequence[int], float]] = (),
                    fixed_s: float = 0.0) -> float:
    """A whole training step from a simulated pipeline: each rank ends its last action;
    each reduction ``(ranks, seconds)`` (an all-reduce of gradients replicated on those
    ranks) waits for the latest of them and holds them all; then every rank does its
    own ``after_s`` (its optimizer step); the step ends with the latest rank, plus the
    runtime's ``fixed_s``. The next step cannot start before.

    >>> from cost_model.schedule import generate
    >>> r = simulate(generate("simple", 2, 2), [StageCost(1.0, 2.0)] * 2)
    >>> r.finish_times(), training_step_s(r, [0.5, 0.5], [((0, 1), 1.0)], 0.25)
    ((9.0, 7.0), 10.75)
    """
    ends = list(sim.finish_times())
    if len(ends) > 1:
        for ranks, seconds in reductions:
            done = max(ends[s] for s in ranks) + seconds
            for s in ranks:
                ends[s] = done
    return max(end + after for end, after in zip(ends, after_s)) + fixed_s


def ascii_timeline(result: SimResult, columns: int = 72) -> str:
    """A proportional text drawing of a simulated timeline, one row per rank: each action
    starts with its microbatch's last digit, then its kind (F, B, I, W)."""
    if not result.timeline:
        return ""
    p = max(e.rank for e in result.timeline) + 1
    scale = columns / result.step_time_s if result.step_time_s > 0 else 0.0
    rows = [[" "] * columns for _ in range(p)]
    for e in result.timeline:
        lo = min(columns - 1, int(e.start_s * scale))
        hi = max(lo + 1, min(columns, int(round(e.end_s * scale))))
        for c in range(lo, hi):
            rows[e.rank][c] = e.action.kind if c > lo else str(e.action.microbatch % 10)
    return "\n".join(f"stage{s} |{''.join(r)}|" for s, r in enumerate(rows))


__all__ = ["BACKWARD", "FORWARD", "SimResult", "StageCost", "TimelineEvent", "ascii_timeline",
           "simulate", "training_step_s"]
