"""The values a pipeline schedule is made of: ``Action``, per-rank lists, chunk placements.

A model is cut into ``p x v`` chunks in model order; a placement gives each chunk's rank
(``round_robin``, ``v_shape`` or any tuple a manual partition dictates). An action is
``"{chunk}{kind}{microbatch}"`` with kinds F, B, I (input gradient) and W (weight
gradient); ``needs`` / ``gives`` name the tokens that order them across ranks.
See docs/schedules.md, 'Schedules are data'.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.errors import ScheduleError

FORWARD = "F"
BACKWARD = "B"
INPUT_GRAD = "I"
WEIGHT_GRAD = "W"
KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)
GRAD_KINDS = (BACKWARD, INPUT_GRAD)
"""The kinds that produce a chunk's input gradient (what the chunk before waits for)."""

_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")

Token = tuple[str, int, int]
"""What flows between actions: ``("F", chunk, mb)`` activations, ``("G", chunk, mb)`` the
input gradient (also the licence for the chunk's ``W``)."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: ``kind`` of ``microbatch`` on chunk ``stage``.

    >>> str(Action(2, "F", 0)), Action.parse("1W3")
    ('2F0', Action(stage=1, kind='W', microbatch=3))
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError.build(
                "an action's kind is 'F', 'B', 'I' or 'W'", self.kind,
                f"Action({self.stage}, {self.kind!r}, {self.microbatch})",
                "use F (forward), B (full backward), I (input gradient), W (weight gradient)")
        if self.stage < 0 or self.microbatch < 0:
            raise ScheduleError.build(
                "an action's stage and microbatch must be >= 0",
                (self.stage, self.microbatch), "Action", "use non-negative indices")

    @property
    def chunk(self) -> int:
        """The chunk (virtual stage, in model order) this action runs: ``stage``."""
        return self.stage

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"2F0"`` -> ``Action(2, "F", 0)``."""
        match = _ACTION_RE.match(text)
        if match is None:
            raise ScheduleError.build(
                "an action string reads '<chunk><F|B|I|W><microbatch>'", text, "Action.parse",
                "write e.g. '2F0', '1B3', '3I1' or '3W1'")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


Schedule = tuple[tuple[Action, ...], ...]
"""One tuple per pipeline rank, in that rank's execution order."""
Placement = tuple[int, ...]
"""The rank of every chunk, indexed by chunk (model order)."""


def needs(action: Action, num_chunks: int) -> Token | None:
    """The token ``action`` waits for (None: the first chunk's forward needs nothing).

    >>> needs(Action(1, "F", 0), 4), needs(Action(1, "I", 0), 4), needs(Action(3, "B", 2), 4)
    (('F', 0, 0), ('G', 2, 0), ('F', 3, 2))
    """
    c, mb = action.stage, action.microbatch
    if action.kind == FORWARD:
        return (FORWARD, c - 1, mb) if c > 0 else None
    if action.kind == WEIGHT_GRAD:
        return ("G", c, mb)
    return ("G", c + 1, mb) if c < num_chunks - 1 else (FORWARD, c, mb)


def gives(action: Action) -> Token | None:
    """The token ``action`` produces (None for ``W``: nothing in the pipeline reads it)."""
    if action.kind == FORWARD:
        return (FORWARD, action.stage, action.microbatch)
    if action.kind in GRAD_KINDS:
        return ("G", action.stage, action.microbatch)
    return None


def round_robin(num_ranks: int, virtual: int = 1) -> Placement:
    """Megatron's interleaved placement: chunk ``c`` on rank ``c % p``.

    >>> round_robin(2, 2)
    (0, 1, 0, 1)
    """
    return tuple(c % num_ranks for c in range(num_ranks * virtual))


def v_shape(num_ranks: int) -> Placement:
    """ZB-V's placement: rank ``r`` holds chunks ``r`` and ``2p - 1 - r``.

    >>> v_shape(3)
    (0, 1, 2, 2, 1, 0)
    """
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def chunks_of(placement: Sequence[int], rank: int) -> tuple[int, ...]:
    """The chunks on ``rank``, in model order."""
    return tuple(c for c, r in enumerate(placement) if r == rank)


def placement_of(schedule: Sequence[Sequence[Action]]) -> Placement:
    """The placement a schedule implies: the rank whose list holds each chunk's actions.

    Raises ``ScheduleError`` when a chunk sits on two ranks or a chunk number is missing."""
    rank_of: dict[int, int] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if rank_of.setdefault(a.stage, rank) != rank:
                raise ScheduleError.build(
                    "each chunk runs on one rank", str(a),
                    f"ranks {rank_of[a.stage]} and {rank}", "move the action to one rank's list")
    missing = [c for c in range(len(rank_of)) if c not in rank_of]
    if missing:
        raise ScheduleError.build("chunks are numbered 0..n-1 in model order",
                                  f"missing chunk {missing[0]}", "the schedule",
                                  "number chunks without gaps")
    return tuple(rank_of[c] for c in range(len(rank_of)))


def format_schedule(schedule: Sequence[Sequence[Action]]) -> list[str]:
    """One line per rank of space-separated action strings (round-trips via ``parse``)."""
    return [" ".join(str(a) for a in actions) for actions in schedule]


def parse_schedule(lines: Sequence[str]) -> Schedule:
    """Inverse of ``format_schedule``."""
    return tuple(tuple(Action.parse(tok) for tok in line.split()) for line in lines)


__all__ = ["BACKWARD", "FORWARD", "GRAD_KINDS", "INPUT_GRAD", "KINDS", "WEIGHT_GRAD", "Action",
           "Placement", "Schedule", "Token", "chunks_of", "format_schedule", "gives", "needs",
           "parse_schedule", "placement_of", "round_robin", "v_shape"]
