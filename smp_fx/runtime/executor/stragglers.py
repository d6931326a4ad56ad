"""Stragglers: a rank persistently slower than the others, named once with where it loses time.

In a synchronous job one slow rank slows every rank, so step times are alike everywhere;
what differs is how a step's time splits. A rank's *own* time is its stages' forward and
backward, which no peer can lengthen; the rest is waiting for others (receiving from a
pipeline peer, the data-parallel reduction) or not comparable across stages (the step
function's own code and turns, ``in step``; the script between steps, ``outside``, whose
own collectives wait there): reported, not judged. The flight record
(``smp_fx.runtime.executor.flight``) already stamps every op, so a step splits at the cost of one
pass over its ops. A reduction waited for inside a stage's last backward is estimated as
that backward's excess over the stage's other backwards; the post-step hooks (explicit
reductions) count as waiting.

Every ``WINDOW`` steps the ranks launch the exchange of the split of their window's step of
least own time (a row of floats, all-gathered over the world's gloo group without waiting;
the names and groups go once, at the first) and read it at the next window's end, so no
step waits for it; from the second window on (the first steps warm up unevenly) they decide
alike, one window late: a rank whose own time is over ``RATIO`` times the median of its
peers' (the ranks holding the same stages; all other ranks when none does) in ``PERSIST``
windows in a row is named in one warning, with the part of its time that exceeds the
peers' most; ``smp.straggler_report()`` returns the last figures.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from smp_fx.runtime.executor.flight import FlightRecorder

log = logging.getLogger(__name__)

WINDOW = 5  # steps per exchange
RATIO = 1.3  # own time over the peers' median that names a straggler
FLOOR_S = 0.002  # and by at least this much per step (timer noise on tiny steps)
PERSIST = 2  # windows in a row a rank must be over, so a loaded machine's noise is not named

OWN = ("forward", "backward")  # judged
WAITING = ("receiving", "reducing")
PARTS = (*OWN, "in step", *WAITING, "outside")
_KIND_PART = {"F": "forward", "B": "backward", "I": "backward", "W": "backward",
              "RECV_ACT": "receiving", "RECV_GRAD": "receiving", "RECV_OUT": "receiving"}

Gather = Callable[[Any], list[Any]]
Launch = Callable[[Sequence[float]], Callable[[], list[list[float]]]]
ROW = (*PARTS, "own")  # an exchanged row's floats


def split_step(flight: FlightRecorder, ended: float, hooks_s: float) -> dict[str, float]:
    """Seconds of the step just recorded in ``flight`` per part (``PARTS``; ``outside`` is
    the caller's); ``ended``: when it ended, ``hooks_s``: its post-step hooks' time."""
    parts = dict.fromkeys(PARTS, 0.0)
    ops, starts = flight.ops, flight.starts
    backwards: dict[int, list[float]] = {}
    for i, op in enumerate(ops):
        took = starts[i + 1] - starts[i]  # starts[len(ops)]: the step's end
        parts[_KIND_PART.get(op.kind, "in step")] += took
        if op.kind in ("B", "W"):
            backwards.setdefault(op.stage, []).append(took)
    if ops:
        parts["receiving"] += ended - starts[len(ops)]  # the step's end: its sends complete
    for times in backwards.values():
        if len(times) > 1:  # the last one waits for the stage's data-parallel reduction
            excess = max(0.0, times[-1] - statistics.median(times[:-1]))
            parts["backward"] -= excess
            parts["reducing"] += excess
    parts["reducing"] += hooks_s
    return parts


class StragglerWatch:
    """Per executor: splits each step, exchanges every ``WINDOW`` steps, names stragglers.

    ``group``: the ranks holding this rank's stages (its data-parallel group);
    ``gather``: the world object all-gather and ``launch`` the world row gather
    (``smp_fx.world.comm.row_gather``; both None: this process is the whole job);
    ``paused``: true once exchanges must stop (after ``join()``, ranks out of data make no
    steps)."""

    def __init__(self, rank: int, group: Sequence[int], gather: Gather | None,
                 launch: Launch | None = None,
                 paused: Callable[[], bool] = lambda: False) -> None:
        self.rank, self.group, self.gather, self.paused = rank, tuple(group), gather, paused
        self.launch: Launch = launch or (lambda row: lambda: [list(row)])
        self.steps = 0
        self.window: list[dict[str, float]] = []
        self.last_end: float | None = None
        self.pending: tuple[int, Callable[[], list[list[float]]]] | None = None
        self.at = 0  # the step ending the window that ``figures`` describe
        self.figures: list[dict[str, float]] = []  # per rank, of the last exchange read
        self.peers: list[list[int]] = []
        self.names: list[str] = []
        self.named: dict[int, dict[str, Any]] = {}
        self.over: dict[int, int] = {}  # windows in a row each rank was over the ratio
        self.stopped = False

    def stop(self) -> None:
        """No more exchanges, for good: for a caller that steps some ranks alone (the
        calibration's one-stage runs), whose exchange would wait for ranks not stepping."""
        self.stopped = True
        self.pending = None

    def step_done(self, flight: FlightRecorder, split: dict[str, float]) -> None:
        """After a step's hooks: record its ``split`` (``split_step``'s); every ``WINDOW``
        steps, read the last window's exchange, judge it, and launch this window's."""
        parts = dict(split)
        parts["outside"] = 0.0 if self.last_end is None else flight.began - self.last_end
        self.last_end = time.monotonic()
        self.window.append(parts)
        self.steps += 1
        if self.stopped or self.paused():  # for good: step counts may differ from now on
            # every rank launched the pending exchange, so it completes unread; ranks that
            # stop stepping could not read it, so none does
            self.window, self.pending = [], None
            return
        if len(self.window) < WINDOW:
            return
        # a loaded machine only adds time (a rank waits for a core); a straggler's lag is in
        # every step: the window's step of least own time is its least noisy
        fastest = min(self.window, key=lambda w: sum(w[p] for p in OWN))
        row = [*(fastest[p] for p in PARTS), sum(fastest[p] for p in OWN)]
        self.window = []
        if self.pending is not None:
            self._read(*self.pending)
        if not self.names:  # once: who is who
            every = [(self.group, flight.me())] if self.gather is None else self.gather(
                (self.group, flight.me()))
            self.names = [n for _, n in every]
            world = list(range(len(every)))
            self.peers = [list(g) if len(g) > 1 else world for g, _ in every]
        self.pending = (self.steps, self.launch(row))

    def _read(self, at: int, read: Callable[[], list[list[float]]]) -> None:
        """Wait for the exchange of the window ending at step ``at`` (launched a window ago:
        done unless a rank is a window behind) and judge it."""
        self.pending = None
        self.figures = [dict(zip(ROW, r, strict=True)) for r in read()]
        self.at = at
        if at == WINDOW:  # the first steps warm up (allocations, caches), unevenly
            return
        for r in range(len(self.figures)):
            if r not in self.named:
                self._judge(r)

    def _judge(self, r: int) -> None:
        own = [f["own"] for f in self.figures]
        others = [q for q in self.peers[r] if q != r]
        if not others:
            return
        base = statistics.median(own[q] for q in others)
        over = own[r] > RATIO * base and own[r] - base >= FLOOR_S
        self.over[r] = self.over.get(r, 0) + 1 if over else 0
        if self.over[r] < PERSIST:
            return
        excess = {p: self.figures[r][p] - statistics.median(self.figures[q][p] for q in others)
                  for p in OWN}
        where = max(excess, key=lambda p: excess[p])
        self.named[r] = {"step": self.at, "ratio": own[r] / base, "where": where,
                         "own_s": own[r], "peers_s": base, "excess_s": excess[where]}
        if self.rank == 0:
            log.warning(
                "straggler: %s spends %.2fx the time of its peers (ranks %s) on its own work "
                "(fastest of steps %d-%d: %.1f ms vs %.1f ms), most of it in "
                "%s (+%.1f ms per step); the others wait for it", self.names[r],
                own[r] / base, ", ".join(map(str, others)), self.at - WINDOW + 1, self.at,
                own[r] * 1e3, base * 1e3, where, excess[where] * 1e3)

    def report(self) -> dict[str, Any]:
        """The figures of the last exchange read (see ``smp.straggler_report``)."""
        return {"steps": self.steps, "at": self.at, "window": WINDOW, "ratio": RATIO,
                "ranks": [dict(f) for f in self.figures],
                "stragglers": {r: dict(v) for r, v in self.named.items()}}


def straggler_report() -> dict[str, Any]:
    """The straggler figures of the current ``DistributedModel`` (smp-fx extension).

    ``ranks[r]``: rank ``r``'s step of least own time in the window ending at step ``at``
    (the last exchange read, a window before the last one launched), in seconds per
    part (``forward``, ``backward``: its own work, summed in ``own``; ``in step``: the step
    function's own code; ``receiving``, ``reducing``: waiting; ``outside``: between steps);
    ``stragglers``: the ranks named so far, each with the step ending the window it was
    named for (the warning comes a window later), its ``ratio`` to its peers and
    ``where`` it loses the most time.
    Empty figures before the first exchange."""
    from smp_fx.world import context  # the runtime does not otherwise reach the model

    model = context.current_model()
    watch: StragglerWatch | None = None
    if model is not None and getattr(model, "partitioned", False):
        watch = getattr(getattr(model, "executor", None), "stragglers", None)
    if watch is None:
        return {"steps": 0, "at": 0, "window": WINDOW, "ratio": RATIO, "ranks": [],
                "stragglers": {}}
    return watch.report()
