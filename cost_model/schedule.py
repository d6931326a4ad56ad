"""Pipeline schedules as data: per-rank tuples of ``Action`` values, and their generators.

The runtime executor and the simulator interpret the very same tuples, so a schedule has
one source of truth; ``validate`` checks any of them. Generators follow SMP's
``pipeline`` names plus ``zero_bubble`` and ``zbv``. ``interleaved`` (1F1B), p=2, m=3::

    clock   0   1   2   3   4   5   6   7
    stage0  F0  F1  .   B0  F2  B1  .   B2
    stage1  .   F0  B0  F1  B1  F2  B2  .

See docs/schedules.md, 'The schedules, on a unit clock'.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from cost_model.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Placement,
    Schedule,
    chunks_of,
    format_schedule,
    parse_schedule,
    placement_of,
    round_robin,
    v_shape,
)
from cost_model.errors import ScheduleError
from cost_model.schedule_check import (
    chunk_peaks,
    clock,
    draw,
    in_flight,
    microbatches_in_flight,
    num_chunks_of,
    validate,
)
from cost_model.schedule_greedy import greedy

SCHEDULE_NAMES = ("simple", "interleaved", "zero_bubble", "zbv")
SPLIT_BACKWARD = ("zero_bubble", "zbv")
"""Schedules whose backward is an I and a W."""


def default_placement(name: str, num_ranks: int, virtual: int) -> Placement:
    """Where chunks go for a schedule: the V for ``zbv``, round robin otherwise."""
    return v_shape(num_ranks) if name == "zbv" else round_robin(num_ranks, virtual)


def default_active(name: str, num_ranks: int, num_microbatches: int, virtual: int = 1) -> int:
    """``active_microbatches`` when unset: SMP's ``num_ranks + 2`` where a cap shortens the
    warm-up, else ``num_microbatches`` (orders with a fixed warm-up would refuse p + 2)."""
    if name == "simple" or name in ("interleaved", "zero_bubble") and virtual == 1:
        return num_ranks + 2
    return max(num_microbatches, 1)


def check_virtual(name: str, num_ranks: int, num_microbatches: int, virtual: int) -> None:
    """Reject schedule, chunk and microbatch combinations that cannot run (``ScheduleError``).

    ``zbv`` needs v = 2; Megatron's interleaving passes microbatches in groups of p."""
    where = f"pipeline={name!r}, virtual_pipeline_degree={virtual}"
    if not isinstance(virtual, int) or virtual < 1:
        raise ScheduleError.build("virtual_pipeline_degree must be an integer >= 1", virtual,
                                  where, "use 1 (one chunk per rank) or more")
    if name == "zbv" and virtual != 2:
        raise ScheduleError.build("pipeline 'zbv' places exactly two chunks per rank (a V)",
                                  virtual, where, "set virtual_pipeline_degree to 2")
    if name in ("interleaved", "zero_bubble") and virtual > 1 and num_microbatches % num_ranks:
        lower = num_microbatches - num_microbatches % num_ranks
        options = " or ".join(str(x) for x in (lower, lower + num_ranks) if x > 0)
        raise ScheduleError.build(
            f"interleaving over {virtual} chunks passes microbatches in groups of "
            f"pipeline_parallel_degree ({num_ranks}): microbatches must be a multiple of it",
            num_microbatches, where,
            f"set microbatches to {options}, or virtual_pipeline_degree to 1, or use "
            "pipeline 'simple' (looped BFS) or 'zbv'")


def check_config(name: str, num_ranks: int, num_microbatches: int, virtual: int,
                 active_given: int | None) -> None:
    """What ``smp.init`` checks of a schedule: ``check_virtual``, and an explicit
    ``active_microbatches`` below what a fixed warm-up (the interleaved orders at v > 1,
    ZB-V) holds. Both raise ``ScheduleError`` (an ``SMPConfigError``) with what works."""
    check_virtual(name, num_ranks, num_microbatches, virtual)
    if active_given is not None and default_active(name, num_ranks, num_microbatches,
                                                   virtual) == num_microbatches:
        generate(name, num_ranks, num_microbatches, active_given, virtual_stages=virtual)


def _waves(m: int, active: int) -> list[range]:
    return [range(start, min(start + active, m)) for start in range(0, m, active)]


def _simple(mine: Sequence[int], m: int, active: int) -> list[Action]:
    out: list[Action] = []
    for wave in _waves(m, active):
        out += [Action(c, FORWARD, mb) for c in mine for mb in wave]
        out += [Action(c, BACKWARD, mb) for c in reversed(mine) for mb in wave]
    return out


def _grouped(mine: Sequence[int], m: int, p: int, reverse: bool) -> list[tuple[int, int]]:
    """Megatron's order of (chunk, microbatch) on one rank: groups of ``p`` microbatches,
    each run through the rank's chunks in turn (in reverse for backwards)."""
    v = len(mine)
    chunks = list(reversed(mine)) if reverse else list(mine)
    if v == 1:
        return [(chunks[0], mb) for mb in range(m)]
    return [(chunks[(k // p) % v], (k // (p * v)) * p + k % p) for k in range(v * m)]


def _one_f_one_b(order_f: list[tuple[int, int]], order_b: list[tuple[int, int]], warmup: int,
                 split: bool, keep_back: int) -> list[Action]:
    """``warmup`` forwards, then one backward and one forward in turn, then the drain.

    With ``split`` each backward is an I, followed by the oldest pending W once more than
    ``keep_back`` are pending; the W's kept back end the list, oldest first."""
    out = [Action(c, FORWARD, mb) for c, mb in order_f[:warmup]]
    pending: deque[tuple[int, int]] = deque()
    next_f = warmup
    for c, mb in order_b:
        out.append(Action(c, INPUT_GRAD if split else BACKWARD, mb))
        if split:
            pending.append((c, mb))
            if len(pending) > keep_back:
                wc, wmb = pending.popleft()
                out.append(Action(wc, WEIGHT_GRAD, wmb))
        if next_f < len(order_f):
            c_f, mb_f = order_f[next_f]
            out.append(Action(c_f, FORWARD, mb_f))
            next_f += 1
    out += [Action(c, WEIGHT_GRAD, mb) for c, mb in pending]
    return out


def _interleaved(mine: Sequence[int], rank: int, p: int, m: int, active: int) -> list[Action]:
    v = len(mine)
    warmup = min(p - rank, m, active) if v == 1 else min((v - 1) * p + 2 * (p - 1 - rank) + 1,
                                                         v * m)
    return _one_f_one_b(_grouped(mine, m, p, False), _grouped(mine, m, p, True), warmup,
                        split=False, keep_back=0)


def _zero_bubble(mine: Sequence[int], rank: int, p: int, m: int, active: int) -> list[Action]:
    v = len(mine)
    if v == 1:
        warmup = min(p - rank, m, active)
        keep_back = max(0, min(rank, active - warmup))
    else:
        warmup, keep_back = min((v - 1) * p + p - rank, v * m), rank
    return _one_f_one_b(_grouped(mine, m, p, False), _grouped(mine, m, p, True), warmup,
                        split=True, keep_back=keep_back)


def _zbv(mine: Sequence[int], rank: int, p: int, m: int) -> list[Action]:
    """ZB-V on one rank, built for ``max(m, 2p - 1)`` microbatches, the extra ones dropped."""
    down, up = mine
    full = max(m, 2 * p - 1)
    nf = {down: 0, up: 0}
    ni = {down: 0, up: 0}
    nw = {down: 0, up: 0}
    out: list[Action] = []

    def run(kind: str, c: int) -> None:
        count = {FORWARD: nf, INPUT_GRAD: ni, WEIGHT_GRAD: nw}[kind]
        out.append(Action(c, kind, count[c]))
        count[c] += 1

    for _ in range(2 * (p - rank) - 1):  # fill: the down chunk until the up chunk's first F
        run(FORWARD, down)
    for _ in range(rank):  # the two chunks' forwards in turn until the first I is back
        run(FORWARD, up)
        run(FORWARD, down)
    for _ in range(p - rank):  # the up chunk in 1F-1I-1W
        run(FORWARD, up)
        run(INPUT_GRAD, up)
        run(WEIGHT_GRAD, up)
    while nf[down] < full or nf[up] < nf[down]:  # steady: both chunks in 1F-1I-1W
        if nf[down] < full:
            run(FORWARD, down)
        run(INPUT_GRAD, down)
        run(WEIGHT_GRAD, down)
        run(FORWARD, up)
        run(INPUT_GRAD, up)
        run(WEIGHT_GRAD, up)
    for _ in range(rank):  # drain: input gradients first, on the critical path
        run(INPUT_GRAD, down)
        run(INPUT_GRAD, up)
    for _ in range(p - rank):
        run(INPUT_GRAD, down)
        run(WEIGHT_GRAD, down)
    while nw[up] < ni[up]:  # the weight gradients kept back fill the tail
        run(WEIGHT_GRAD, up)
    while nw[down] < ni[down]:
        run(WEIGHT_GRAD, down)
    if not nf == ni == nw == {down: full, up: full}:
        raise ScheduleError.build("ZB-V's phases leave every chunk's F, I and W balanced",
                                  (nf, ni, nw), f"rank {rank}", "report this as a bug")
    return [a for a in out if a.microbatch < m]


def _rank_list(name: str, mine: Sequence[int], rank: int, p: int, m: int, active: int
               ) -> list[Action]:
    if name == "simple":
        return _simple(mine, m, active)
    if name == "interleaved":
        return _interleaved(mine, rank, p, m, active)
    if name == "zero_bubble":
        return _zero_bubble(mine, rank, p, m, active)
    return _zbv(mine, rank, p, m)


def _check_sizes(num_stages: int, num_microbatches: int, active: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("active_microbatches", active)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError.build(f"{name} must be an integer >= 1", value,
                                      "cost_model.schedule.generate", f"pass {name}=1 or more")


def generate(name: str, num_stages: int, num_microbatches: int,
             active_microbatches: int | None = None, forward_only: bool = False,
             virtual_stages: int = 1, placement: Placement | None = None) -> Schedule:
    """Per-rank action lists for SMP's ``pipeline`` = ``name`` on ``num_stages`` ranks.

    A placement other than the default is list-scheduled (``schedule_greedy``); the
    ``active_microbatches`` rules are in docs/schedules.md, 'Configuration rules'.

    >>> [" ".join(map(str, s)) for s in generate("interleaved", 2, 2)]
    ['0F0 0F1 0B0 0B1', '1F0 1B0 1F1 1B1']
    >>> [" ".join(map(str, s)) for s in generate("zero_bubble", 2, 2)]
    ['0F0 0F1 0I0 0W0 0I1 0W1', '1F0 1I0 1F1 1I1 1W0 1W1']
    """
    p, m = num_stages, num_microbatches
    if name not in SCHEDULE_NAMES:
        raise ScheduleError.build("the pipeline schedule must be one of " + str(SCHEDULE_NAMES),
                                  name, "cost_model.schedule.generate",
                                  "set pipeline to 'simple', 'interleaved', 'zero_bubble' or "
                                  "'zbv'")
    capped = active_microbatches is not None
    active = (default_active(name, p, m, virtual_stages) if active_microbatches is None
              else active_microbatches)
    _check_sizes(p, m, active)
    check_virtual(name, p, m, virtual_stages)
    where = placement if placement is not None else default_placement(name, p, virtual_stages)
    if sorted(set(where)) != list(range(p)):
        raise ScheduleError.build(
            f"a placement gives each of the {p} ranks at least one chunk", where,
            f"pipeline={name!r}", "place p x v chunks, v on each rank, or pin modules to "
            "every rank")
    mine = [chunks_of(where, r) for r in range(p)]
    if forward_only:
        return tuple(tuple(Action(c, FORWARD, mb) for c in mine[r] for mb in range(m))
                     for r in range(p))
    if name in ("interleaved", "zero_bubble") and tuple(where) != default_placement(
            name, p, virtual_stages):  # the constructions are for round robin: list-schedule
        return greedy(where, m, active if capped else min(active, p + 2),
                      split=name in SPLIT_BACKWARD)
    if name == "zbv" and tuple(where) != v_shape(p):
        raise ScheduleError.build("pipeline 'zbv' runs on the V placement", where,
                                  "cost_model.schedule.generate", "leave placement unset")
    schedule = tuple(tuple(_rank_list(name, mine[r], r, p, m, active)) for r in range(p))
    if capped:
        peaks = [max(microbatches_in_flight(s), default=0) for s in schedule]
        if max(peaks) > active:
            rank = peaks.index(max(peaks))
            raise ScheduleError.build(
                f"pipeline {name!r} at virtual_pipeline_degree {virtual_stages} holds "
                f"{max(peaks)} microbatches on rank {rank}: active_microbatches cannot be lower",
                active, f"p={p}, m={m}", f"leave active_microbatches unset or set it to "
                f">= {max(peaks)}")
    return schedule


__all__ = ["BACKWARD", "FORWARD", "INPUT_GRAD", "SCHEDULE_NAMES", "SPLIT_BACKWARD",
           "WEIGHT_GRAD", "Action", "Placement", "Schedule", "check_config", "check_virtual",
           "chunk_peaks",
           "chunks_of", "clock", "default_active", "default_placement", "draw",
           "format_schedule", "generate", "in_flight", "microbatches_in_flight",
           "num_chunks_of", "parse_schedule", "placement_of", "round_robin", "v_shape",
           "validate"]
