"""The flight record: what this rank did in its current step, kept always, told on failure.

A pipeline that stops shows up on the ranks that wait, not on the one that stopped: rank 0
times out waiting for rank 1, which may itself wait for rank 2. So every rank keeps a
record of its step that costs next to nothing (a clock read and a list store per op) and
tells it when the step fails on a peer (a timeout, a lost connection): the last ops with
their start times, what it waits for and from whom, and where each microbatch's step
function is. A rank that waits on no peer (its step function blocks, or never calls the
model) has no timeout of its own to trip: a watchdog thread tells its record once its step
has made no progress for 0.75 x the timeout, so it speaks before the ranks waiting on it
time out and the launcher stops the job. Every record goes to stderr and, with
``SMP_FX_DUMP_DIR`` set, to ``flight_rank<r>.txt`` there; read together, the records name
the rank that stopped. ``smp-fx run`` gets the same facts through the failure reports
(``smp_fx.world.reports``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from cost_model.errors import SMPPeerError, SMPTimeoutError
from smp_fx.runtime.executor.lowering import Op, describe, stage_name
from smp_fx.world import reports

LAST_OPS = 8  # ops shown in a record
STALL_FRACTION = 0.75  # of the timeout: when the watchdog tells a stalled step

Status = Callable[[], list[str]]  # lines on where the step's threads are (the conductor's)


class FlightRecorder:
    """The record of one executor's steps on this rank (see the module doc).

    ``ranks[s]``: the global rank holding stage ``s`` (across processes; None in-process).
    ``status``: lines on where the step functions are, for a record; ``busy``: whether a
    thread is performing an op right now (both the conductor's)."""

    def __init__(self, rank: int, stages: Sequence[int], ranks: Sequence[int] | None,
                 timeout_s: float, status: Status | None = None,
                 busy: Callable[[], bool] | None = None) -> None:
        self.rank = rank
        self.stages = tuple(stages)
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.status = status
        self.busy = busy
        self.step = -1  # steps begun, counting from 0
        self.ops: tuple[Op, ...] = ()
        self.starts: list[float] = []  # per op position (and one more: the step's end)
        self.at = -1  # the op last started (-1: none yet; len(ops): the step's end)
        self.began = 0.0
        self.running = False
        self._told_step = -1  # the last step whose record was told
        self._watchdog: threading.Thread | None = None

    # ---- the hot path: one call per op -----------------------------------------------
    def begin(self, ops: tuple[Op, ...]) -> None:
        self.step += 1
        self.ops = ops
        self.starts = [0.0] * (len(ops) + 1)
        self.at = -1
        self.began = time.monotonic()
        self.running = True

    def mark(self, i: int) -> None:
        """Op ``i`` starts (``len(ops)``: the step's end, waiting for its sends)."""
        self.at = i
        self.starts[i] = time.monotonic()

    def end(self) -> None:
        self.running = False

    # ---- words -------------------------------------------------------------------------
    def describe(self, op: Op) -> str:
        return describe(op, self.ranks)

    def me(self) -> str:
        """``rank 0 (stage 0)``."""
        return f"rank {self.rank} ({', '.join(stage_name(s) for s in self.stages)})"

    def doing(self) -> str:
        """What the step is at, in words."""
        at, ops = self.at, self.ops
        if 0 <= at < len(ops):
            return describe(ops[at], self.ranks)
        if at == len(ops) and ops:
            return "waiting for its sends of the step to complete"
        return "starting the step"

    def where(self) -> str:
        """``rank 0 (stage 0) in step 3, while receiving ...``: for error messages."""
        if not self.running:
            return f"{self.me()} between steps"
        return f"{self.me()} in step {self.step}, while {self.doing()}"

    def record(self, reason: str) -> str:
        """The flight record as text: a header, what it waits for, the last ops."""
        now = time.monotonic()
        lines = [f"smp-fx flight record of {self.me()}, step {self.step}: {reason}"]
        at = self.at
        if self.running:
            since = self.starts[at] if 0 <= at < len(self.starts) else self.began
            lines.append(f"  at: {self.doing()}, for {now - since:.1f} s")
        if self.status is not None:
            lines += ["  " + s for s in self.status()]
        first = max(0, min(at, len(self.ops) - 1) - LAST_OPS + 1)
        if self.ops and at >= 0:
            lines.append("  last ops (seconds since the step began):")
            for i in range(first, min(at, len(self.ops) - 1) + 1):
                op = self.ops[i]
                mark = ">" if i == at else " "
                lines.append(f"  {mark} {self.starts[i] - self.began:8.3f}  {str(op):14s} "
                             f"{describe(op, self.ranks)}")
            if at < len(self.ops) - 1:
                lines.append(f"    {len(self.ops) - 1 - at} more op(s) to go, next: "
                             f"{describe(self.ops[at + 1], self.ranks)}")
        elif self.ops:
            lines.append(f"  no op started yet; first: {describe(self.ops[0], self.ranks)}")
        return "\n".join(lines) + "\n"

    def tell(self, reason: str) -> str:
        """Write the record to stderr and ``$SMP_FX_DUMP_DIR/flight_rank<r>.txt``."""
        text = self.record(reason)
        self._told_step = self.step
        sys.stderr.write(text)
        sys.stderr.flush()
        directory = os.environ.get("SMP_FX_DUMP_DIR")
        if directory:
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, f"flight_rank{self.rank}.txt"), "a",
                      encoding="utf-8") as fh:
                fh.write(text)
        return text

    # ---- failures ----------------------------------------------------------------------
    def failed(self, exc: BaseException) -> None:
        """A step failed: report it for the launcher (first: the launcher stops this process
        soon after another one failed), and tell the record if a peer is involved."""
        reports.failed(self.rank, self.stages, exc)
        if isinstance(exc, (SMPTimeoutError, SMPPeerError)) and self._told_step != self.step:
            self.tell(f"{type(exc).__name__}: {exc}")

    def watch(self) -> None:
        """Start the stall watchdog (once): a daemon thread that ends with this recorder."""
        if self._watchdog is None:
            tick = min(1.0, self.timeout_s / 20)
            self._watchdog = threading.Thread(target=_watch, args=(weakref.ref(self), tick),
                                              name="smp-fx-watchdog", daemon=True)
            self._watchdog.start()

    def stalled_for(self, now: float) -> float:
        """Seconds since the step last made progress (0 when not running or already told).
        A transfer in flight does not count: its own bounded wait reports it."""
        if not self.running or self._told_step == self.step:
            return 0.0
        at = self.at
        if at >= len(self.ops) > 0:  # the step's end: a bounded wait for its sends
            return 0.0
        performing = self.busy is not None and self.busy()
        if performing and at >= 0 and self.ops[at].kind not in ("F", "B", "WAIT_B"):
            return 0.0
        since = self.starts[at] if 0 <= at < len(self.starts) else self.began
        return now - since


def _watch(ref: weakref.ReferenceType[FlightRecorder], tick: float) -> None:
    while True:
        time.sleep(tick)
        rec = ref()
        if rec is None:
            return
        idle = rec.stalled_for(time.monotonic())
        if idle >= STALL_FRACTION * rec.timeout_s:
            text = rec.tell(f"no progress for {idle:.1f} s (timeout {rec.timeout_s:.0f} s)")
            reports.stalled(rec.rank, rec.stages, text)
        del rec
