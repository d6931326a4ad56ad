"""The conductor: the step function's threads take turns through one ordered op list.

The user's step function runs once per microbatch. ``model(...)`` posts an F request and
waits for the model outputs; ``model.backward(...)`` posts a B request and returns once it
cannot run the next op itself: the backward runs at its turn in the schedule, and gradients
are complete when ``smp.step`` returns (where SMP's documentation puts optimizer.step()), so a
step function that has asked for its backward needs no thread of its own any more and the
calling thread moves on to the next microbatch. Turns are granted strictly by position in
the op list (``smp_fx.runtime.lowering``), so every rank issues its sends and receives in
schedule order. The conductor is a baton, not a thread: whichever waiting thread finds the
next op runnable (its microbatch's request has arrived, or it is a transfer) executes it
through the ``execute`` callback it was given and keeps going; a driver that hands model
outputs to another waiting thread stops and lets that thread carry on, so only one thread
drives at a time. A finished backward is not handed over: its thread only has to return,
so the driver keeps going.

Step functions start lazily: the calling thread runs each microbatch's function in turn and
a pool thread starts one only when the next op needs a microbatch while every driver is
stuck mid-function (a pipeline with several microbatches in flight). On a rank whose
``model(...)`` waits for outputs computed elsewhere (``next_forward`` given), each forward
starts the function of the microbatch whose forward comes next, so its request is in
before its turn and the driver never waits for a thread to start (starting them all at
once would make them contend with the step's first forward).

Grad mode and autocast captured from the requesting thread travel with its request
(``smp_fx.runtime.modes``). A failure in any thread aborts the step: the caller re-raises
the original exception and every thread is released. A thread waiting for its turn while a
driver performs an op keeps waiting past the timeout: the driver's own wait is bounded (a
transfer's timeout names the peer it waits for, which says more than "no turn came"), so
the conductor times out only when no thread is performing an op. ``status`` tells where
every microbatch's step function is, for the flight record (``smp_fx.runtime.flight``),
in the words of ``smp_fx.runtime.turns``.
The conductor knows ops only by kind and microbatch; what an op does, and every value it
moves, is the executor's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from cost_model.errors import SMPInternalError, SMPRuntimeError, SMPTimeoutError
from smp_fx.runtime.lowering import Op
from smp_fx.runtime.modes import Autocast, autocast_state, thread_modes
from smp_fx.runtime.turns import (
    Microbatch,
    Request,
    StepView,
    Turn,
    next_op_words,
    status_lines,
)
from smp_fx.world import context

Execute = Callable[[int, Op], None]  # (position in the op list, op): performs one op


class _Aborted(BaseException):
    """Raised in user threads when the step aborts; BaseException so user code cannot eat it."""


DRIVER_GRACE = 3  # timeouts a waiting thread gives a driver whose own wait is bounded


class Conductor:
    """Turn-taking over an op list; ``execute(position, op)`` performs each op."""

    def __init__(self, execute: Execute, timeout_s: float = 300.0, rank: int = 0,
                 describe: Callable[[Op], str] = str) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.describe = describe  # an op in words, for errors and status
        self._execute = execute
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._lock = threading.Lock()
        self._conds: list[threading.Condition] = []
        self._main = threading.Condition(self._lock)
        self._turns: list[Turn] = []
        self._done: list[bool] = []
        self._ops: tuple[Op, ...] = ()
        self._next = 0
        self._driving = False
        self._handed_to = -1
        self._holder: int | None = None
        self._running = 0
        self._started: list[bool] = []
        self._futures: dict[int, Future[Any]] = {}
        self._launch: tuple[Callable[..., Any], Sequence[Microbatch], bool, Autocast] | None = (
            None)
        self._main_thread: threading.Thread | None = None
        self._next_forward: Sequence[int] | None = None
        self._deferred: list[tuple[int, Any]] = []
        self._main_waiting = 0  # threads waiting on ``_main``
        self._abort: BaseException | None = None
        self._abort_status: list[str] = []  # ``status`` when the last step aborted

    # ---- user-thread side -------------------------------------------------------------
    def forward_request(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``model(*args, **kwargs)`` in microbatch ``mb``'s step function: its outputs."""
        t = self._turns[mb]
        with self._lock:
            if t.f_request is not None:
                raise SMPRuntimeError.build(
                    "the model may be called once per microbatch inside smp.step", mb,
                    f"rank {self.rank} microbatch {mb}", "call model(...) once per step fn")
            t.f_request = Request((args, kwargs), torch.is_grad_enabled(), autocast_state())
            self._drive(lambda: t.outputs_ready, mb, "its model outputs")
        return t.outputs

    def backward_request(self, mb: int, tensors: Any, grad_tensors: Any) -> None:
        """``model.backward(tensors, grad_tensors)`` in microbatch ``mb``'s step function."""
        t = self._turns[mb]
        with self._lock:
            if t.f_request is None or t.b_request is not None:
                raise SMPRuntimeError.build(
                    "model.backward must follow model(...) and run once per microbatch", mb,
                    f"rank {self.rank} microbatch {mb}", "call model.backward(loss) once")
            t.b_request = Request((tensors, grad_tensors), torch.is_grad_enabled(),
                                  autocast_state())
            self._drive(lambda: t.backward_done, mb, "its backward pass", wait=False,
                        lazy=True)

    # ---- executor side: what a turn's op reads and publishes -------------------------
    def forward_of(self, mb: int, stage: int) -> Request:
        """Microbatch ``mb``'s F request (its F op is runnable, so it asked or returned)."""
        req = self._turns[mb].f_request
        if req is None:
            raise SMPRuntimeError.build(
                "the smp.step function returned without calling the DistributedModel",
                f"microbatch {mb}", f"rank {self.rank} stage {stage}",
                "call model(...) inside every smp.step function")
        return req

    def backward_of(self, mb: int) -> Request | None:
        """Microbatch ``mb``'s B request; None if its step function has not asked (yet)."""
        return self._turns[mb].b_request

    def publish_outputs(self, mb: int, outputs: Any, hand: bool = True,
                        defer: bool = False) -> None:
        """Give microbatch ``mb``'s ``model(...)`` call its outputs and wake its thread.

        ``hand``: that thread carries on driving (it must run user code to post its next
        request). ``defer`` (no hand-over): at the driver's next ``flush`` instead, because
        a woken step function competes for the CPU (and the GIL) with the driver's work;
        the driver flushes when it would wait anyway (blocking on a message that has not
        arrived, or the end of its turn)."""
        with self._lock:
            if defer:
                self._deferred.append((mb, outputs))
                return
            self._give_outputs(mb, outputs)
            if hand:
                self._handed_to = mb

    def publish_backward_done(self, mb: int) -> None:
        """Microbatch ``mb``'s backward is complete on this rank. Not handed over: the
        thread only returns, so the driver keeps going (a thread switch saved per op)."""
        with self._lock:
            self._turns[mb].backward_done = True
            self._conds[mb].notify_all()

    def flush(self) -> None:
        """Apply the deferred publications (the transport calls this before it blocks)."""
        if self._deferred:
            with self._lock:
                self._flush_locked()

    def _give_outputs(self, mb: int, outputs: Any) -> None:
        t = self._turns[mb]
        t.outputs, t.outputs_ready = outputs, True
        self._conds[mb].notify_all()

    def _flush_locked(self) -> None:
        for mb, outputs in self._deferred:
            self._give_outputs(mb, outputs)
        self._deferred.clear()

    # ---- the baton ----------------------------------------------------------------------
    def _runnable(self, op: Op) -> bool:
        if op.kind == "F":
            return self._turns[op.microbatch].f_request is not None or self._done[op.microbatch]
        if op.kind == "WAIT_B":
            return (self._turns[op.microbatch].b_request is not None
                    or self._done[op.microbatch])
        return True

    def _may_drive(self, mb: int) -> bool:
        """Whether the thread of ``mb`` (< 0: the caller after its own work) runs the next op.

        Only when no other thread is driving or was just handed the baton, and, for a thread
        whose step function has returned, when no step function is running Python either.
        """
        return (not self._driving and self._holder is None and self._next < len(self._ops)
                and self._runnable(self._ops[self._next]) and (mb >= 0 or self._running == 0))

    def _drive(self, ready: Callable[[], bool], mb: int, what: str, wait: bool = True,
               lazy: bool = False) -> None:
        """With the lock held: run ops while they can run, until ``ready()``; else sleep
        (``wait``) or return. ``lazy``: see ``_take_turn``."""
        cond = self._conds[mb] if mb >= 0 else self._main
        if self._holder == mb:
            self._holder = None
        while True:
            if self._abort is not None:
                raise _Aborted()
            if ready():
                return
            if self._may_drive(mb):
                stopped = self._take_turn(mb, lazy)
                if ready() or stopped:
                    return
            if not wait:
                return
            self._sleep(cond, mb, what)

    def _take_turn(self, mb: int, lazy: bool) -> bool:
        """With the lock held: execute ops in order while the next one can run, until the
        baton is handed to another thread. ``lazy`` (a thread done with its own microbatch):
        stop before a receive for a microbatch whose step function has not started, so that
        function's start overlaps the message in flight instead of following it (its
        ``model(...)`` call drives the receive); returns whether it stopped there."""
        ops = self._ops
        self._driving = True
        try:
            while self._next < len(ops) and self._runnable(ops[self._next]):
                op = ops[self._next]
                if lazy and op.kind.startswith("RECV") and not self._started[op.microbatch]:
                    return True
                if op.kind == "F" and self._next_forward is not None:
                    j = self._next_forward[self._next]
                    if j >= 0 and not self._started[j]:
                        self._start(j)
                self._handed_to = -1
                self._lock.release()
                try:
                    self._execute(self._next, op)
                finally:
                    self._lock.acquire()
                self._next += 1
                k = self._handed_to
                if k not in (-1, mb) and not self._done[k]:
                    self._holder = k  # the woken thread carries on from here
                    break
        except BaseException as exc:
            if not isinstance(exc, _Aborted):
                self._fail(exc)
            self._wake_all()
            raise
        finally:
            self._driving = False
            if self._deferred:
                self._flush_locked()
            self._wake_main()  # the caller may be waiting for the last op
        return False

    def _sleep(self, cond: threading.Condition, mb: int, what: str) -> None:
        """With the lock held: wait for a wake-up, bounded by the timeout."""
        ops = self._ops
        if mb < 0 and self._running == 0 and self._holder is None and all(self._done) \
                and not self._driving and self._next < len(ops) and not self._may_drive(mb):
            raise SMPInternalError.build("the step cannot make progress",
                                         str(ops[self._next]), f"rank {self.rank}")
        if mb >= 0:
            self._start_needed()
            self._running -= 1
            if self._running == 0:
                self._wake_main()
        else:
            self._main_waiting += 1
        try:
            woke = cond.wait(self.timeout_s)
            grace = DRIVER_GRACE
            while not woke and self._driving and self._abort is None and grace:
                woke, grace = cond.wait(self.timeout_s), grace - 1  # its wait is bounded
        finally:
            if mb >= 0:
                self._running += 1
            else:
                self._main_waiting -= 1
        if not woke:
            who = f"microbatch {mb}'s step function" if mb >= 0 else "the smp.step call"
            raise SMPTimeoutError.build(
                f"{who} waited {self.timeout_s:.0f} s for {what}, and no thread performed an "
                "op", next_op_words(self._view(), self.describe), f"rank {self.rank}",
                "a step function blocks (on something outside smp-fx, or on another "
                "microbatch); see the flight record above")

    def _view(self) -> StepView:
        """With the lock held: the step now, for the words of ``smp_fx.runtime.turns``."""
        return StepView(self._ops, self._next, self._driving, self._turns, self._started,
                        self._done, self._runnable)

    def status(self) -> list[str]:
        """Where the step is, for a flight record: the next op and what keeps it, and each
        microbatch's step function (the lines of the last aborted step between steps)."""
        if not self._lock.acquire(timeout=1.0):
            return ["(the conductor's lock is held: a thread is stuck inside it)"]
        try:
            if not self._turns or self._abort is not None:
                return list(self._abort_status)
            return self._status_lines()
        finally:
            self._lock.release()

    def _status_lines(self) -> list[str]:
        return status_lines(self._view(), self.describe)

    def performing(self) -> bool:
        """Whether a thread is performing an op now (its wait, if any, is bounded)."""
        return self._driving

    def _fail(self, exc: BaseException) -> None:
        """With the lock held: abort the step with ``exc`` (the first failure wins), keeping
        ``status`` as it was when it failed, then release every thread."""
        if self._abort is None:
            self._abort = exc
            self._abort_status = self._status_lines()
        self._wake_all()

    def _wake_all(self) -> None:
        for c in self._conds:
            c.notify_all()
        self._main.notify_all()

    def _wake_main(self) -> None:
        """With the lock held: wake a thread waiting on ``_main``, if any (this runs after
        every driver's turn; a notify costs three Python calls even with nobody waiting)."""
        if self._main_waiting:
            self._main.notify_all()

    # ---- a step -------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], microbatches: Sequence[Microbatch],
            ops: tuple[Op, ...], next_forward: Sequence[int] | None = None
            ) -> tuple[list[Any], list[bool]]:
        """Run ``fn`` once per microbatch while ``ops`` are executed in order.

        Returns ``fn``'s results and, per microbatch, whether its step function called
        ``model.backward``. ``next_forward`` (``Lowered.next_forward``): start step
        functions a forward ahead (see the module doc)."""
        m = len(microbatches)
        self._turns = [Turn() for _ in range(m)]
        self._done = [False] * m
        self._conds = [threading.Condition(self._lock) for _ in range(m)]
        self._ops, self._next, self._driving = ops, 0, False
        self._holder, self._running = None, 0
        self._abort, self._abort_status = None, []
        self._deferred = []
        if m > 1 and (self._pool is None or self._pool_size < m - 1):
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = ThreadPoolExecutor(m - 1, "smp-step"), m - 1
        grad, autocast = torch.is_grad_enabled(), autocast_state()
        self._started = [False] * m
        self._futures = {}
        self._launch = (fn, microbatches, grad, autocast)
        self._main_thread = threading.current_thread()
        self._next_forward = next_forward
        results: list[Any] = [None] * m
        try:
            while True:  # the calling thread runs every microbatch nobody else started
                with self._lock:
                    j = next((k for k in range(m) if not self._started[k]), None)
                    if j is not None:
                        self._started[j] = True
                if j is None:
                    break
                try:
                    results[j] = self._user_thread(fn, j, *microbatches[j], grad, autocast)
                except _Aborted:
                    break
            with self._lock:
                self._drive(lambda: all(self._done) and self._next == len(self._ops), -1,
                            "every microbatch to finish")
            for mb, f in sorted(self._futures.items()):
                results[mb] = f.result(timeout=self.timeout_s)
            asked = [t.b_request is not None for t in self._turns]
        except BaseException as exc:
            with self._lock:
                self._fail(exc)
            for f in list(self._futures.values()):
                with contextlib.suppress(BaseException):
                    f.result(timeout=self.timeout_s)
            raise (self._abort if self._abort is not None else exc) from None
        finally:
            self._turns = []
        return results, asked

    def _user_thread(self, fn: Callable[..., Any], mb: int, args: tuple[Any, ...],
                     kwargs: dict[str, Any], grad: bool, autocast: Autocast) -> Any:
        context.enter_turn(self, mb)
        with self._lock:
            self._running += 1
        try:
            with thread_modes(grad, autocast):
                return fn(*args, **kwargs)
        except _Aborted:
            raise
        except BaseException as exc:
            with self._lock:
                self._fail(exc)
            raise
        finally:
            context.leave_turn()
            with self._lock:
                self._done[mb] = True
                self._running -= 1
                if self._holder == mb:
                    self._holder = None
                self._wake_main()
                if self._abort is None and self._may_drive(-2):
                    # this return may unblock the next op (a skipped backward): run it
                    with contextlib.suppress(_Aborted):
                        self._drive(lambda: not self._may_drive(-2), -2, "", lazy=True)
                if self._abort is None and threading.current_thread() is not self._main_thread:
                    self._start_needed()  # the calling thread may be asleep mid-function

    def _start_needed(self) -> None:
        """With the lock held, by a thread that cannot run it itself: if the next op needs a
        microbatch whose step function has not started, start it on a pool thread.

        Microbatches start lazily, so a schedule that finishes one microbatch before it
        needs the next (pp = 1, or the last stage) runs entirely in the calling thread."""
        if self._driving or self._holder is not None or self._next >= len(self._ops):
            return
        op = self._ops[self._next]
        if op.kind == "F" and not self._started[op.microbatch]:
            self._start(op.microbatch)

    def _start(self, j: int) -> None:
        """With the lock held: run microbatch ``j``'s step function on a pool thread."""
        self._started[j] = True
        if self._pool is None or self._launch is None:
            raise SMPInternalError.build("a step function needs a pool thread, but the step "
                                         "has one microbatch", j, f"rank {self.rank}")
        fn, mbs, grad, autocast = self._launch
        args, kwargs = mbs[j]
        self._futures[j] = self._pool.submit(self._user_thread, fn, j, args, kwargs, grad,
                                             autocast)
