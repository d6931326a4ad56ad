"""Pipeline schedules as data: per-stage lists of ``Action`` values.

A schedule is ``tuple[tuple[Action, ...], ...]``: one tuple per pipeline stage, in the
order that stage executes its work. The runtime executor and the simulator
(``cost_model.simulate``) interpret the very same tuples, so there is exactly one source of
truth for what a schedule does; no schedule here has a hand-written loop elsewhere.

Two generators, named as SMP's ``pipeline`` parameter names them:

``"simple"`` (fill-drain, GPipe). Every stage runs all forwards of a wave, then all its
backwards. Backwards run in *forward* microbatch order (0, 1, ...), as SMP's step function
calls ``model.backward`` for microbatch 0 first and as ``torch.distributed.pipelining``'s
GPipe does. ``active_microbatches`` (at most that many microbatches forwarded and not yet
backwarded on a stage) splits the batch into waves of fill-drain. p=2, m=2 on a unit clock::

    clock   0   1   2   3   4   5
    stage0  F0  F1  .   .   B0  B1
    stage1  .   F0  F1  B0  B1  .

``"interleaved"`` (1F1B, backward as soon as possible). Stage ``s`` runs
``min(p - s, m, active_microbatches)`` warm-up forwards and then alternates one backward,
one forward, and finally drains the remaining backwards. A stage therefore holds at most
``min(p - s, m)`` microbatches' activations, against ``m`` for ``"simple"``. p=2, m=3::

    clock   0   1   2   3   4   5   6   7
    stage0  F0  F1  .   B0  F2  B1  .   B2
    stage1  .   F0  B0  F1  B1  F2  B2  .

``validate`` checks that a list is complete, ordered and deadlock-free; ``draw`` prints the
tables above (``clock`` is the unit-time execution they show).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.errors import ScheduleError

FORWARD = "F"
BACKWARD = "B"
SCHEDULE_NAMES = ("simple", "interleaved")

_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FB])\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: ``kind`` ("F" or "B") of ``microbatch`` on ``stage``.

    >>> str(Action(2, "F", 0)), Action.parse("1B3")
    ('2F0', Action(stage=1, kind='B', microbatch=3))
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD):
            raise ScheduleError.build(
                "an action's kind must be 'F' or 'B'", self.kind, f"Action({self.stage}, "
                f"{self.kind!r}, {self.microbatch})", "use 'F' for forward, 'B' for backward")
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError.build(
                "an action's stage and microbatch must be >= 0",
                (self.stage, self.microbatch), "Action", "use non-negative indices")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"2F0"`` -> ``Action(2, "F", 0)``."""
        match = _ACTION_RE.match(text)
        if match is None:
            raise ScheduleError.build(
                "an action string reads '<stage><F|B><microbatch>'", text, "Action.parse",
                "write e.g. '2F0' or '1B3'")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


Schedule = tuple[tuple[Action, ...], ...]


def _check_sizes(num_stages: int, num_microbatches: int, active: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("active_microbatches", active)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError.build(f"{name} must be an integer >= 1", value,
                                      "cost_model.schedule.generate", f"pass {name}=1 or more")


def _simple_stage(stage: int, m: int, active: int) -> tuple[Action, ...]:
    actions: list[Action] = []
    for start in range(0, m, active):
        wave = range(start, min(start + active, m))
        actions += [Action(stage, FORWARD, mb) for mb in wave]
        actions += [Action(stage, BACKWARD, mb) for mb in wave]
    return tuple(actions)


def _interleaved_stage(stage: int, p: int, m: int, active: int) -> tuple[Action, ...]:
    warmup = min(p - stage, m, active)
    actions = [Action(stage, FORWARD, mb) for mb in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < m:
        actions.append(Action(stage, BACKWARD, next_b))
        next_b += 1
        if next_f < m:
            actions.append(Action(stage, FORWARD, next_f))
            next_f += 1
    return tuple(actions)


def generate(name: str, num_stages: int, num_microbatches: int,
             active_microbatches: int | None = None, forward_only: bool = False) -> Schedule:
    """Per-stage action lists for SMP's ``pipeline`` = ``name``.

    ``active_microbatches`` defaults to ``num_stages + 2`` (SMP's default) and is a hard cap
    on microbatches in flight on any stage. ``forward_only`` (evaluation) emits forwards only,
    in microbatch order: nothing is saved for backward, so nothing is in flight.

    >>> [" ".join(map(str, s)) for s in generate("interleaved", 2, 2)]
    ['0F0 0F1 0B0 0B1', '1F0 1B0 1F1 1B1']
    """
    active = num_stages + 2 if active_microbatches is None else active_microbatches
    _check_sizes(num_stages, num_microbatches, active)
    if name not in SCHEDULE_NAMES:
        raise ScheduleError.build("the pipeline schedule must be one of " + str(SCHEDULE_NAMES),
                                  name, "cost_model.schedule.generate",
                                  "set pipeline to 'simple' or 'interleaved'")
    if forward_only:
        return tuple(tuple(Action(s, FORWARD, mb) for mb in range(num_microbatches))
                     for s in range(num_stages))
    if name == "simple":
        return tuple(_simple_stage(s, num_microbatches, active) for s in range(num_stages))
    return tuple(_interleaved_stage(s, num_stages, num_microbatches, active)
                 for s in range(num_stages))


def dependency(action: Action, num_stages: int) -> Action | None:
    """The action on another stage whose output ``action`` consumes (None: it needs none).

    F(s, mb) needs F(s-1, mb)'s activations; B(s, mb) needs B(s+1, mb)'s gradients. The last
    stage's B(mb) depends on its own F(mb), which its list orders (checked by ``validate``).
    """
    if action.kind == FORWARD:
        return Action(action.stage - 1, FORWARD, action.microbatch) if action.stage > 0 else None
    if action.stage < num_stages - 1:
        return Action(action.stage + 1, BACKWARD, action.microbatch)
    return None


def clock(schedule: Sequence[Sequence[Action]]) -> list[list[Action | None]]:
    """Run the lists in lock step, one time unit per action, transfers instantaneous.

    Returns one row per clock tick with each stage's action (None = idle). A stage runs its
    next action at tick t when the action it depends on finished at a tick before t. Raises
    ``ScheduleError`` naming the first tick at which no stage can move (a deadlock).
    """
    p = len(schedule)
    done_at: dict[Action, int] = {}
    cursor = [0] * p
    ticks: list[list[Action | None]] = []
    total = sum(len(s) for s in schedule)
    while len(done_at) < total:
        tick = len(ticks)
        row: list[Action | None] = [None] * p
        for s in range(p):
            if cursor[s] == len(schedule[s]):
                continue
            action = schedule[s][cursor[s]]
            dep = dependency(action, p)
            if dep is None or done_at.get(dep, tick) < tick:
                row[s] = action
        if all(a is None for a in row):
            waiting = ", ".join(f"stage {s} waits at {schedule[s][cursor[s]]} for "
                                f"{dependency(schedule[s][cursor[s]], p)}"
                                for s in range(p) if cursor[s] < len(schedule[s]))
            raise ScheduleError.build("the schedule deadlocks: no stage can run its next action",
                                      waiting, f"clock tick {tick}",
                                      "reorder the lists so every dependency can run first")
        for s, ran in enumerate(row):
            if ran is not None:
                done_at[ran] = tick
                cursor[s] += 1
        ticks.append(row)
    return ticks


def in_flight(actions: Sequence[Action]) -> list[int]:
    """Microbatches forwarded but not yet backwarded after each action of one stage."""
    count, out = 0, []
    for action in actions:
        count += 1 if action.kind == FORWARD else -1
        out.append(count)
    return out


def validate(schedule: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int,
             forward_only: bool = False, active_microbatches: int | None = None) -> int:
    """Check a schedule; return its length in unit clock ticks.

    Rules: one list per stage holding only that stage's actions; each (stage, microbatch)
    has exactly one F and (unless ``forward_only``) exactly one B, the B after the F; no more
    than ``active_microbatches`` in flight (when given); and the lists run to completion
    when every stage executes its own list in order (see ``clock``).
    """
    if len(schedule) != num_stages:
        raise ScheduleError.build("a schedule has one action list per stage",
                                  len(schedule), f"num_stages={num_stages}",
                                  "generate it with the same num_stages")
    kinds = (FORWARD,) if forward_only else (FORWARD, BACKWARD)
    for s, actions in enumerate(schedule):
        where = f"stage {s}"
        seen: dict[tuple[str, int], int] = {}
        for i, action in enumerate(actions):
            if action.stage != s:
                raise ScheduleError.build("a stage's list holds only that stage's actions",
                                          str(action), where, "move the action to its stage")
            if action.kind not in kinds or action.microbatch >= num_microbatches:
                raise ScheduleError.build(
                    f"actions are {'/'.join(kinds)} of microbatches 0..{num_microbatches - 1}",
                    str(action), where, "drop the action or fix the microbatch count")
            key = (action.kind, action.microbatch)
            if key in seen:
                raise ScheduleError.build("each (stage, microbatch) has exactly one F and one B",
                                          str(action), f"{where}, positions {seen[key]} and "
                                          f"{i}", "remove the duplicate")
            if action.kind == BACKWARD and (FORWARD, action.microbatch) not in seen:
                raise ScheduleError.build("a backward comes after its forward on its stage",
                                          str(action), f"{where}, position {i}",
                                          "put F before B for this microbatch")
            seen[key] = i
        missing = [f"{s}{k}{mb}" for k in kinds for mb in range(num_microbatches)
                   if (k, mb) not in seen]
        if missing:
            raise ScheduleError.build("each (stage, microbatch) has exactly one F and one B",
                                      f"missing {' '.join(missing[:6])}", where,
                                      "add the missing actions")
        if active_microbatches is not None and not forward_only:
            peak = max(in_flight(actions), default=0)
            if peak > active_microbatches:
                raise ScheduleError.build("at most active_microbatches may be in flight",
                                          peak, f"{where} (cap {active_microbatches})",
                                          "interleave backwards earlier or raise the cap")
    return len(clock(schedule))


def format_schedule(schedule: Sequence[Sequence[Action]]) -> list[str]:
    """One line per stage of space-separated action strings (round-trips via ``parse``)."""
    return [" ".join(str(a) for a in actions) for actions in schedule]


def parse_schedule(lines: Sequence[str]) -> Schedule:
    """Inverse of ``format_schedule``."""
    return tuple(tuple(Action.parse(tok) for tok in line.split()) for line in lines)


def draw(schedule: Sequence[Sequence[Action]]) -> str:
    """ASCII table of the unit-clock execution: one row per stage, one column per tick."""
    ticks = clock(schedule)
    labels = ["clock"] + [f"stage{s}" for s in range(len(schedule))]
    label_w = max(len(x) for x in labels)
    cell_w = max([len(f"{a.kind}{a.microbatch}") for s in schedule for a in s]
                 + [len(str(len(ticks) - 1))])
    lines = ["  ".join([labels[0].ljust(label_w)]
                       + [str(t).ljust(cell_w) for t in range(len(ticks))]).rstrip()]
    for s in range(len(schedule)):
        cells = [labels[s + 1].ljust(label_w)]
        for row in ticks:
            a = row[s]
            cells.append((f"{a.kind}{a.microbatch}" if a else ".").ljust(cell_w))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
