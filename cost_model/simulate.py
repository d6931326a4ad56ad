"""Run a schedule's action lists on the cost model: predicted step time, memory, timeline.

The simulator interprets the same ``cost_model.schedule`` tuples the runtime executor runs.
It is event driven: an action starts when its stage is free and its input has arrived.
Timing model (documented because plans quote its numbers):

- F(s, mb) takes ``fwd_time_s`` of stage s; B(s, mb) takes ``bwd_time_s``.
- F(s, mb)'s input is F(s-1, mb)'s boundary output, sent over the link s-1 -> s: it
  occupies the link for ``send_fwd_s`` of stage s-1 and arrives ``latency_s`` later;
  B(s, mb)'s input is B(s+1, mb)'s gradient, sent likewise in ``send_bwd_s`` of stage s+1.
  A transfer does not occupy the sender's compute (asynchronous send) but transfers on one
  link and direction go one at a time, in the sender's order; latency delays arrival
  without keeping the link busy (architecture.md "Stage time model").
- Fixed costs: every action also takes ``action_overhead_s`` (the runtime's turn and the
  step function's work) plus ``message_overhead_s`` per message the stage receives or
  sends for it (posting and completing it takes the rank's own time, unlike latency).
- Memory of stage s = ``static_bytes`` + ``saved_bytes_per_mb`` x microbatches in flight
  (forwarded, not yet backwarded); the peak is over the stage's list. A forward-only
  schedule keeps nothing for backward, so its in-flight count is 0.
- Bubble fraction = 1 - (sum of compute time) / (stages x makespan).

p=2, m=2, simple, fwd 1, bwd 2, no transfer time: stage 1 runs F0 [1,2] F1 [2,3]
B0 [3,5] B1 [5,7]; stage 0 runs B0 [5,7] B1 [7,9]; step 9, bubble 1 - 12/18 = 1/3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cost_model.errors import ScheduleError
from cost_model.schedule import BACKWARD, FORWARD, Action, dependency, in_flight


@dataclass(frozen=True)
class StageCost:
    """What one microbatch costs on one stage, as the simulator needs it."""

    fwd_time_s: float
    bwd_time_s: float
    send_fwd_s: float = 0.0
    send_bwd_s: float = 0.0
    static_bytes: int = 0
    saved_bytes_per_mb: int = 0
    latency_s: float = 0.0
    action_overhead_s: float = 0.0
    message_overhead_s: float = 0.0

    def duration(self, kind: str, stage: int, num_stages: int) -> float:
        """Seconds stage ``stage`` is busy for one action of ``kind`` (F or B)."""
        messages = (stage > 0) + (stage < num_stages - 1)  # one in, one out, per side
        work = self.fwd_time_s if kind == FORWARD else self.bwd_time_s
        return work + self.action_overhead_s + messages * self.message_overhead_s

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageCost:
        return cls(**data)


@dataclass(frozen=True)
class TimelineEvent:
    """One executed action: ``stage`` ran ``action`` from ``start_s`` to ``end_s``."""

    stage: int
    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """Prediction for one training step (all microbatches) of a schedule."""

    step_time_s: float
    bubble_fraction: float
    busy_s: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_memory_bytes: tuple[int, ...]
    timeline: tuple[TimelineEvent, ...]

    def finish_times(self) -> tuple[float, ...]:
        """When each stage ends its last action (0 for a stage with none)."""
        ends = [0.0] * len(self.busy_s)
        for e in self.timeline:
            ends[e.stage] = max(ends[e.stage], e.end_s)
        return tuple(ends)

    def chrome_trace(self) -> list[dict[str, Any]]:
        """Events for chrome://tracing / Perfetto (one thread per stage, microseconds)."""
        return [{"name": str(e.action), "ph": "X", "pid": 0, "tid": e.stage,
                 "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
                 "cat": "forward" if e.action.kind == FORWARD else "backward"}
                for e in self.timeline]


def simulate(schedule: Sequence[Sequence[Action]],
             stage_costs: Sequence[StageCost]) -> SimResult:
    """Predict the step time, memory and timeline of ``schedule`` under ``stage_costs``.

    >>> from cost_model.schedule import generate
    >>> r = simulate(generate("simple", 2, 2), [StageCost(1.0, 2.0)] * 2)
    >>> r.step_time_s, round(r.bubble_fraction, 4)
    (9.0, 0.3333)
    """
    p = len(schedule)
    if len(stage_costs) != p:
        raise ScheduleError.build("simulate needs one StageCost per stage", len(stage_costs),
                                  f"schedule with {p} stages", "pass one cost per stage")
    arrival: dict[Action, float] = {}  # when an action's output reaches the stage needing it
    link_free: dict[tuple[int, str], float] = {}
    stage_free = [0.0] * p
    cursor = [0] * p
    events: list[TimelineEvent] = []
    remaining = sum(len(s) for s in schedule)
    while remaining:
        progressed = False
        for s in range(p):
            while cursor[s] < len(schedule[s]):
                action = schedule[s][cursor[s]]
                dep = dependency(action, p)
                if dep is not None and dep not in arrival:
                    break
                ready = arrival[dep] if dep is not None else 0.0
                start = max(stage_free[s], ready)
                cost = stage_costs[s]
                end = start + cost.duration(action.kind, s, p)
                events.append(TimelineEvent(s, action, start, end))
                stage_free[s] = end
                cursor[s] += 1
                remaining -= 1
                progressed = True
                sends_to = s + 1 if action.kind == FORWARD else s - 1
                if 0 <= sends_to < p:
                    link = (s, action.kind)
                    send = cost.send_fwd_s if action.kind == FORWARD else cost.send_bwd_s
                    send_start = max(end, link_free.get(link, 0.0))
                    link_free[link] = send_start + send
                    arrival[action] = send_start + send + cost.latency_s
        if not progressed:
            stuck = ", ".join(f"stage {s} at {schedule[s][cursor[s]]}" for s in range(p)
                              if cursor[s] < len(schedule[s]))
            raise ScheduleError.build("the schedule deadlocks in simulation", stuck,
                                      "cost_model.simulate", "check it with schedule.validate")
    makespan = max((e.end_s for e in events), default=0.0)
    busy = tuple(sum(e.end_s - e.start_s for e in events if e.stage == s) for s in range(p))
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0
    # forward-only (evaluation) schedules save nothing for backward: nothing is in flight
    training = any(a.kind == BACKWARD for actions in schedule for a in actions)
    peaks = tuple(max([0] + in_flight(schedule[s])) if training else 0 for s in range(p))
    memory = tuple(c.static_bytes + c.saved_bytes_per_mb * k for c, k in zip(stage_costs, peaks))
    events.sort(key=lambda e: (e.start_s, e.stage))
    return SimResult(makespan, bubble, busy, peaks, memory, tuple(events))


def training_step_s(sim: SimResult, after_s: Sequence[float],
                    reductions: Sequence[tuple[Sequence[int], float]] = (),
                    fixed_s: float = 0.0) -> float:
    """A whole training step from a simulated pipeline: each stage ends its last action;
    each reduction ``(stages, seconds)`` (an all-reduce of gradients replicated on those
    stages) waits for the latest of them and holds them all; then every stage does its
    own ``after_s`` (its optimizer step); the step ends with the latest stage, plus the
    runtime's ``fixed_s``. The next step cannot start before.

    >>> from cost_model.schedule import generate
    >>> r = simulate(generate("simple", 2, 2), [StageCost(1.0, 2.0)] * 2)
    >>> r.finish_times(), training_step_s(r, [0.5, 0.5], [((0, 1), 1.0)], 0.25)
    ((9.0, 7.0), 10.75)
    """
    ends = list(sim.finish_times())
    if len(ends) > 1:
        for stages, seconds in reductions:
            done = max(ends[s] for s in stages) + seconds
            for s in stages:
                ends[s] = done
    return max(end + after for end, after in zip(ends, after_s)) + fixed_s


def ascii_timeline(result: SimResult, columns: int = 72) -> str:
    """A proportional text drawing of a simulated timeline (F = forward, B = backward)."""
    if not result.timeline:
        return ""
    p = max(e.stage for e in result.timeline) + 1
    scale = columns / result.step_time_s if result.step_time_s > 0 else 0.0
    rows = [[" "] * columns for _ in range(p)]
    for e in result.timeline:
        lo = min(columns - 1, int(e.start_s * scale))
        hi = max(lo + 1, min(columns, int(round(e.end_s * scale))))
        mark = "F" if e.action.kind == FORWARD else "B"
        for c in range(lo, hi):
            rows[e.stage][c] = mark if c > lo else str(e.action.microbatch % 10)
    return "\n".join(f"stage{s} |{''.join(r)}|" for s, r in enumerate(rows))


__all__ = ["BACKWARD", "FORWARD", "SimResult", "StageCost", "TimelineEvent", "ascii_timeline",
           "simulate", "training_step_s"]
