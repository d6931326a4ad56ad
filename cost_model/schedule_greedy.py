"""Schedules for any chunk placement: the lists a unit-time list scheduler produces.

The published schedules are constructions for their own placements; a manual partition
may place chunks otherwise, and ``greedy`` lets each idle rank pick by the schedule's
preference. See docs/schedules.md, 'Manual partitions with several chunks per rank'.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_model.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Schedule,
    Token,
    gives,
    needs,
)


def greedy(placement: Sequence[int], num_microbatches: int, active: int, split: bool
           ) -> Schedule:
    """Per-rank lists for chunks placed by ``placement`` (the rank of each chunk).

    >>> from cost_model.actions import format_schedule
    >>> format_schedule(greedy((0, 0, 1, 1), 2, 2, split=False))
    ['0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1', '2F0 3F0 3B0 2B0 2F1 3F1 3B1 2B1']
    """
    n, m = len(placement), num_microbatches
    ranks = 1 + max(placement, default=-1)
    back = INPUT_GRAD if split else BACKWARD
    todo = {r: [Action(c, k, mb) for c in range(n) if placement[c] == r
                for mb in range(m) for k in ((FORWARD, back, WEIGHT_GRAD) if split
                                              else (FORWARD, back))]
            for r in range(ranks)}
    lists: list[list[Action]] = [[] for _ in range(ranks)]
    given: dict[Token, int] = {}
    holds: list[dict[int, int]] = [{} for _ in range(ranks)]  # mb -> chunks held
    tick = 0
    while any(todo.values()):
        ran: list[Action] = []
        for r in range(ranks):
            ready = [a for a in todo[r] if _ready(a, n, given, tick)]
            pick = _choose(ready, holds[r], active)
            if pick is None:
                continue
            todo[r].remove(pick)
            lists[r].append(pick)
            _hold(holds[r], pick)
            ran.append(pick)
        for a in ran:
            token = gives(a)
            if token is not None:
                given[token] = tick
        tick += 1
    return tuple(tuple(x) for x in lists)


def _ready(a: Action, n: int, given: dict[Token, int], tick: int) -> bool:
    need = needs(a, n)
    return need is None or given.get(need, tick) < tick


def _choose(ready: list[Action], held: dict[int, int], active: int) -> Action | None:
    backs = [a for a in ready if a.kind in (BACKWARD, INPUT_GRAD)]
    if backs:
        return min(backs, key=lambda a: (a.microbatch, -a.stage))
    fwds = [a for a in ready if a.kind == FORWARD
            and (a.microbatch in held or len(held) < active)]
    if fwds:
        return min(fwds, key=lambda a: (a.microbatch, a.stage))
    ws = [a for a in ready if a.kind == WEIGHT_GRAD]
    return min(ws, key=lambda a: (a.microbatch, -a.stage)) if ws else None


def _hold(held: dict[int, int], a: Action) -> None:
    mb = a.microbatch
    if a.kind == FORWARD:
        held[mb] = held.get(mb, 0) + 1
    elif a.kind in (BACKWARD, WEIGHT_GRAD):
        held[mb] -= 1
        if held[mb] == 0:
            del held[mb]


__all__ = ["greedy"]
