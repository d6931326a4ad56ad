"""Checking and picturing schedules: the one validator, the unit clock, in-flight counts.

``validate`` is the one place that says what a schedule must be; a deadlock is an error
naming the tick and what each rank waits for.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.actions import (
    BACKWARD,
    FORWARD,
    GRAD_KINDS,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Token,
    gives,
    needs,
    placement_of,
)
from cost_model.errors import ScheduleError


def num_chunks_of(schedule: Sequence[Sequence[Action]]) -> int:
    """How many chunks the lists name (the largest chunk number + 1)."""
    return 1 + max((a.stage for actions in schedule for a in actions), default=-1)


def clock(schedule: Sequence[Sequence[Action]]) -> list[list[Action | None]]:
    """Run the lists in lock step, one tick per action; ``ScheduleError`` names a deadlock."""
    p = len(schedule)
    n = num_chunks_of(schedule)
    given_at: dict[Token, int] = {}
    cursor = [0] * p
    ticks: list[list[Action | None]] = []
    total = sum(len(s) for s in schedule)
    done = 0
    while done < total:
        tick = len(ticks)
        row: list[Action | None] = [None] * p
        for r in range(p):
            if cursor[r] == len(schedule[r]):
                continue
            action = schedule[r][cursor[r]]
            need = needs(action, n)
            if need is None or given_at.get(need, tick) < tick:
                row[r] = action
        if all(a is None for a in row):
            waiting = ", ".join(f"rank {r} waits at {schedule[r][cursor[r]]} for "
                                f"{needs(schedule[r][cursor[r]], n)}"
                                for r in range(p) if cursor[r] < len(schedule[r]))
            raise ScheduleError.build("the schedule deadlocks: no rank can run its next action",
                                      waiting, f"clock tick {tick}",
                                      "reorder the lists so every dependency can run first")
        for r, ran in enumerate(row):
            if ran is not None:
                token = gives(ran)
                if token is not None:
                    given_at[token] = tick
                cursor[r] += 1
                done += 1
        ticks.append(row)
    return ticks


def in_flight(actions: Sequence[Action]) -> list[int]:
    """(chunk, microbatch) activations one rank holds after each action; an ``I`` leaves its
    activations held for the pending W."""
    count, out = 0, []
    for action in actions:
        if action.kind == FORWARD:
            count += 1
        elif action.kind in (BACKWARD, WEIGHT_GRAD):
            count -= 1
        out.append(count)
    return out


def chunk_peaks(schedule: Sequence[Sequence[Action]]) -> dict[int, int]:
    """Per chunk, the most microbatches whose activations it holds at once (forwarded, and
    not yet through their B or W): what the partitioner charges its saved bytes by."""
    peaks: dict[int, int] = {}
    for actions in schedule:
        held: dict[int, int] = {}
        for a in actions:
            if a.kind == FORWARD:
                held[a.stage] = held.get(a.stage, 0) + 1
            elif a.kind in (BACKWARD, WEIGHT_GRAD):
                held[a.stage] -= 1
            peaks[a.stage] = max(peaks.get(a.stage, 0), held.get(a.stage, 0))
    return peaks


def microbatches_in_flight(actions: Sequence[Action]) -> list[int]:
    """Distinct microbatches one rank holds anything of after each of its actions: what
    ``active_microbatches`` caps (with one chunk per rank, the same as ``in_flight``)."""
    held: dict[int, int] = {}
    out = []
    for action in actions:
        mb = action.microbatch
        if action.kind == FORWARD:
            held[mb] = held.get(mb, 0) + 1
        elif action.kind in (BACKWARD, WEIGHT_GRAD):
            held[mb] = held.get(mb, 0) - 1
            if held[mb] <= 0:
                del held[mb]
        out.append(len(held))
    return out


def _check_list(r: int, actions: Sequence[Action], num_microbatches: int,
                forward_only: bool) -> set[tuple[int, str, int]]:
    """Per-rank rules: kinds, microbatch range, one of each, the order on the rank."""
    where = f"rank {r}"
    seen: dict[tuple[int, str, int], int] = {}
    allowed = (FORWARD,) if forward_only else (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)
    for i, a in enumerate(actions):
        if a.kind not in allowed or a.microbatch >= num_microbatches:
            raise ScheduleError.build(
                f"actions are {'/'.join(allowed)} of microbatches 0..{num_microbatches - 1}",
                str(a), where, "drop the action or fix the microbatch count")
        key = (a.stage, a.kind, a.microbatch)
        if key in seen:
            raise ScheduleError.build(
                "each (chunk, microbatch) has exactly one F and one B (or one I and one W)",
                str(a), f"{where}, positions {seen[key]} and {i}", "remove the duplicate")
        if a.kind in GRAD_KINDS and (a.stage, FORWARD, a.microbatch) not in seen:
            raise ScheduleError.build("a backward comes after its forward on its rank",
                                      str(a), f"{where}, position {i}",
                                      "put F before B (or I) for this microbatch")
        if a.kind == WEIGHT_GRAD and (a.stage, INPUT_GRAD, a.microbatch) not in seen:
            raise ScheduleError.build("a weight gradient comes after its input gradient",
                                      str(a), f"{where}, position {i}",
                                      "put I before W for this microbatch")
        if a.kind in GRAD_KINDS and (a.stage, BACKWARD if a.kind == INPUT_GRAD else
                                     INPUT_GRAD, a.microbatch) in seen:
            raise ScheduleError.build(
                "a microbatch's backward on a chunk is one B, or one I and one W",
                str(a), f"{where}, position {i}", "keep either the B or the I/W pair")
        seen[key] = i
    return set(seen)


def _missing(c: int, seen: set[tuple[int, str, int]], num_microbatches: int,
             forward_only: bool) -> list[str]:
    """The actions chunk ``c`` lacks: an F, a backward (named B), or the W of an I."""
    out = []
    for mb in range(num_microbatches):
        if (c, FORWARD, mb) not in seen:
            out.append(f"{c}F{mb}")
        if forward_only:
            continue
        if (c, INPUT_GRAD, mb) in seen:
            if (c, WEIGHT_GRAD, mb) not in seen:
                out.append(f"{c}W{mb}")
        elif (c, BACKWARD, mb) not in seen:
            out.append(f"{c}B{mb}")
    return out


def validate(schedule: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int,
             forward_only: bool = False, active_microbatches: int | None = None,
             num_chunks: int | None = None) -> int:
    """Check a schedule; return its length in unit clock ticks."""
    if len(schedule) != num_stages:
        raise ScheduleError.build("a schedule has one action list per rank",
                                  len(schedule), f"num_stages={num_stages}",
                                  "generate it with the same num_stages")
    chunks = num_stages if num_chunks is None else num_chunks
    placement = placement_of(schedule)
    if len(placement) != chunks:
        raise ScheduleError.build("a schedule names every chunk 0..n-1", len(placement),
                                  f"num_chunks={chunks}", "generate it for the same chunks")
    for r, actions in enumerate(schedule):
        seen = _check_list(r, actions, num_microbatches, forward_only)
        gaps = [x for c in range(chunks) if placement[c] == r
                for x in _missing(c, seen, num_microbatches, forward_only)]
        if gaps:
            raise ScheduleError.build(
                "each (chunk, microbatch) has exactly one F and one B (or one I and one W)",
                f"missing {' '.join(gaps[:6])}", f"rank {r}", "add the missing actions")
        if active_microbatches is not None and not forward_only:
            peak = max(microbatches_in_flight(actions), default=0)
            if peak > active_microbatches:
                raise ScheduleError.build("at most active_microbatches may be in flight",
                                          peak, f"rank {r} (cap {active_microbatches})",
                                          "interleave backwards earlier or raise the cap")
    return len(clock(schedule))


def draw(schedule: Sequence[Sequence[Action]]) -> str:
    """ASCII table of the unit-clock execution: one row per rank, one column per tick."""
    ticks = clock(schedule)
    several = num_chunks_of(schedule) > len(schedule)

    def cell(a: Action) -> str:
        return str(a) if several else f"{a.kind}{a.microbatch}"

    word = "rank" if several else "stage"
    labels = ["clock"] + [f"{word}{s}" for s in range(len(schedule))]
    label_w = max(len(x) for x in labels)
    cell_w = max([len(cell(a)) for s in schedule for a in s] + [len(str(len(ticks) - 1))])
    lines = ["  ".join([labels[0].ljust(label_w)]
                       + [str(t).ljust(cell_w) for t in range(len(ticks))]).rstrip()]
    for s in range(len(schedule)):
        cells = [labels[s + 1].ljust(label_w)]
        for row in ticks:
            a = row[s]
            cells.append((cell(a) if a else ".").ljust(cell_w))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


__all__ = ["chunk_peaks", "clock", "draw", "in_flight", "microbatches_in_flight",
           "num_chunks_of", "validate"]
