"""The conductor: the step function's threads take turns through one ordered op list.

Turns follow the op list, so every rank issues its transfers in schedule order; the
conductor is a baton, not a thread: whichever waiting thread finds the next op runnable
performs it. Step functions start lazily. A straight-through step (``straight.py``) runs
the ops on the calling thread, each step function there once its outputs are. It knows
ops by kind and microbatch only; what one step holds is a ``StepTurns`` dropped after it.
See docs/runtime.md ('Threads', 'Per-step state').
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from cost_model.errors import SMPInternalError, SMPRuntimeError, SMPTimeoutError
from smp_fx.runtime.executor.lowering import Op
from smp_fx.runtime.executor.modes import autocast_state, thread_modes
from smp_fx.runtime.executor.straight import (
    ArgMap,
    Learned,
    Modes,
    Pieces,
    args_mismatch,
    call_mismatch,
    not_called,
)
from smp_fx.runtime.executor.turns import (
    Microbatch,
    Request,
    StepTurns,
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
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._step: StepTurns | None = None  # the running step
        self._last_abort: list[str] = []  # ``status`` of the last step, if it aborted
        self.threads_started = 0  # step functions run on pool threads, all steps
        self.straight_steps = 0  # steps run straight through
        self.ops_done = False  # whether the last straight step performed every op
        self.last_calls: list[Modes | None] = []  # the last step's model(...) call modes
        self.last_maps: list[ArgMap | None] = []  # and their maps, where learned
        self.args_strayed = False  # the last step's call strayed from its map
        # a straight step's model(...) call (microbatch, args, kwargs): checks made late
        self.on_straight_call: Callable[[int, tuple[Any, ...], dict[str, Any]], None] | None = None

    # ---- user-thread side -------------------------------------------------------------
    def forward_request(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``model(*args, **kwargs)`` in microbatch ``mb``'s step function: its outputs."""
        s = self._step
        assert s is not None  # called during a step only (a turn, an op)
        t = s.turns[mb]
        with self._lock:
            if t.f_request is not None:
                raise SMPRuntimeError.build(
                    "the model may be called once per microbatch inside smp.step", mb,
                    f"rank {self.rank} microbatch {mb}", "call model(...) once per step fn")
            t.f_request = Request((args, kwargs), torch.is_grad_enabled(), autocast_state())
            if s.straight is None:
                if s.learn_args:
                    t.arg_map = ArgMap.learn((args, kwargs), s.pieces[mb])
                self._drive(s, lambda: t.outputs_ready, mb, "its model outputs")
                return t.outputs
            want = (s.straight.grad_enabled, s.straight.autocast)
            got = (t.f_request.grad_enabled, t.f_request.autocast)
            exc: SMPRuntimeError | None = None
            if got != want:
                exc = call_mismatch(mb, self.rank, want, got)
            elif s.arg_map is not None and not s.arg_map.matches((args, kwargs), s.pieces[mb]):
                exc, self.args_strayed = args_mismatch(mb, self.rank), True
            if exc is not None:  # kept too: the step fails even if the step function catches it
                self._keep(s, exc)
                raise exc
            if not t.outputs_ready:
                raise SMPInternalError.build("a straight step function ran before its "
                                             "outputs", mb, f"rank {self.rank}")
        if self.on_straight_call is not None:
            self.on_straight_call(mb, args, kwargs)
        return t.outputs

    def backward_request(self, mb: int, tensors: Any, grad_tensors: Any) -> None:
        """``model.backward(tensors, grad_tensors)`` in microbatch ``mb``'s step function."""
        s = self._step
        assert s is not None  # called during a step only (a turn, an op)
        t = s.turns[mb]
        with self._lock:
            if t.f_request is None or t.b_request is not None:
                raise SMPRuntimeError.build(
                    "model.backward must follow model(...) and run once per microbatch", mb,
                    f"rank {self.rank} microbatch {mb}", "call model.backward(loss) once")
            t.b_request = Request((tensors, grad_tensors), torch.is_grad_enabled(),
                                  autocast_state())
            if s.straight is not None:
                return  # checked at the step's end against the gradient messages
            self._drive(s, lambda: t.backward_done, mb, "its backward pass", wait=False,
                        lazy=True)

    # ---- executor side: what a turn's op reads and publishes -------------------------
    def forward_of(self, mb: int, stage: int) -> Request:
        """Microbatch ``mb``'s F request (its F op is runnable, so it asked or returned)."""
        s = self._step
        assert s is not None
        if s.straight is not None:
            if s.arg_map is None:
                return s.straight
            t = s.turns[mb]
            if t.built is None:
                t.built = Request(s.arg_map.build(s.pieces[mb]), s.straight.grad_enabled,
                                  s.straight.autocast)
            return t.built
        req = s.turns[mb].f_request
        if req is None:
            raise SMPRuntimeError.build(
                "the smp.step function returned without calling the DistributedModel",
                f"microbatch {mb}", f"rank {self.rank} stage {stage}",
                "call model(...) inside every smp.step function")
        return req

    def backward_of(self, mb: int) -> Request | None:
        """Microbatch ``mb``'s B request; None if its step function has not asked (yet)."""
        s = self._step
        assert s is not None
        return s.turns[mb].b_request

    def publish_outputs(self, mb: int, outputs: Any, hand: bool = True,
                        defer: bool = False) -> None:
        """Give microbatch ``mb``'s ``model(...)`` call its outputs and wake its thread: ``hand``,
        it drives on; ``defer``, at the driver's next ``flush``, so a woken step function
        does not compete with the driver for the CPU."""
        s = self._step
        assert s is not None  # called during a step only (a turn, an op)
        with self._lock:
            if s.straight is not None:
                s.give_outputs(mb, outputs)
                s.ready.append(mb)
                return
            if defer:
                s.deferred.append((mb, outputs))
                return
            s.give_outputs(mb, outputs)
            if hand:
                s.handed_to = mb

    def publish_backward_done(self, mb: int) -> None:
        """Microbatch ``mb``'s backward is complete on this rank. Not handed over: the
        thread only returns, so the driver keeps going (a thread switch saved per op)."""
        s = self._step
        assert s is not None  # called during a step only (a turn, an op)
        with self._lock:
            s.turns[mb].backward_done = True
            s.conds[mb].notify_all()

    def flush(self) -> None:
        """Apply the deferred publications (the transport calls this before it blocks)."""
        s = self._step
        if s is not None and s.ready:
            self._run_ready(s)
        elif s is not None and s.deferred:
            with self._lock:
                s.flush()

    # ---- the baton ----------------------------------------------------------------------
    @staticmethod
    def _may_drive(s: StepTurns, mb: int) -> bool:
        """Whether the thread of ``mb`` (< 0: the caller after its own work) runs the next op:
        only when nobody drives or holds the baton."""
        return (not s.driving and s.holder is None and s.next < len(s.ops)
                and s.runnable(s.ops[s.next]) and (mb >= 0 or s.running == 0))

    def _drive(self, s: StepTurns, ready: Callable[[], bool], mb: int, what: str,
               wait: bool = True, lazy: bool = False) -> None:
        """With the lock held: run ops while they can run, until ``ready()``; else sleep
        (``wait``) or return. ``lazy``: see ``_take_turn``."""
        cond = s.conds[mb] if mb >= 0 else s.main
        if s.holder == mb:
            s.holder = None
        while True:
            if s.abort is not None:
                raise _Aborted()
            if ready():
                return
            if self._may_drive(s, mb):
                stopped = self._take_turn(s, mb, lazy)
                if ready() or stopped:
                    return
            if not wait:
                return
            self._sleep(s, cond, mb, what)

    def _take_turn(self, s: StepTurns, mb: int, lazy: bool) -> bool:
        """With the lock held: execute ops while the next can run. ``lazy``: stop before a
        receive for an unstarted step function, so its start overlaps the message."""
        ops = s.ops
        s.driving = True
        try:
            while s.next < len(ops) and s.runnable(ops[s.next]):
                op = ops[s.next]
                if lazy and op.kind.startswith("RECV") and not s.started[op.microbatch]:
                    return True
                if op.kind == "F" and s.next_forward is not None:
                    j = s.next_forward[s.next]
                    if j >= 0 and not s.started[j]:
                        self._start(s, j)
                s.handed_to = -1
                self._lock.release()
                try:
                    self._execute(s.next, op)
                finally:
                    self._lock.acquire()
                s.next += 1
                k = s.handed_to
                if k not in (-1, mb) and not s.done[k]:
                    s.holder = k  # the woken thread carries on from here
                    break
        except BaseException as exc:
            if not isinstance(exc, _Aborted):
                self._fail(s, exc)
            s.wake_all()
            raise
        finally:
            s.driving = False
            if s.deferred:
                s.flush()
            s.wake_main()  # the caller may be waiting for the last op
        return False

    def _sleep(self, s: StepTurns, cond: threading.Condition, mb: int, what: str) -> None:
        """With the lock held: wait for a wake-up, bounded by the timeout."""
        if mb < 0 and s.running == 0 and s.holder is None and all(s.done) \
                and not s.driving and s.next < len(s.ops) and not self._may_drive(s, mb):
            raise SMPInternalError.build("the step cannot make progress",
                                         str(s.ops[s.next]), f"rank {self.rank}")
        if mb >= 0:
            self._start_needed(s)
            s.running -= 1
            if s.running == 0:
                s.wake_main()
        else:
            s.main_waiting += 1
        try:
            woke = cond.wait(self.timeout_s)
            grace = DRIVER_GRACE
            while not woke and s.driving and s.abort is None and grace:
                woke, grace = cond.wait(self.timeout_s), grace - 1  # its wait is bounded
        finally:
            if mb >= 0:
                s.running += 1
            else:
                s.main_waiting -= 1
        if not woke:
            who = f"microbatch {mb}'s step function" if mb >= 0 else "the smp.step call"
            raise SMPTimeoutError.build(
                f"{who} waited {self.timeout_s:.0f} s for {what}, and no thread performed an "
                "op", next_op_words(s.view(), self.describe), f"rank {self.rank}",
                "a step function blocks (on something outside smp-fx, or on another "
                "microbatch); see the flight record above")

    def status(self) -> list[str]:
        """Where the step is, for a flight record: the next op and what keeps it, and each
        microbatch's step function (the lines of the last aborted step between steps)."""
        if not self._lock.acquire(timeout=1.0):
            return ["(the conductor's lock is held: a thread is stuck inside it)"]
        try:
            s = self._step
            if s is None:
                return list(self._last_abort)
            if s.abort is not None:
                return list(s.abort_status)
            return status_lines(s.view(), self.describe)
        finally:
            self._lock.release()

    def performing(self) -> bool:
        """Whether a thread is performing an op now (its wait, if any, is bounded)."""
        s = self._step
        return s is not None and s.driving

    def _keep(self, s: StepTurns, exc: BaseException) -> None:
        """With the lock held: ``exc`` is the step's failure unless one came first."""
        if s.abort is None:
            s.abort = exc
            s.abort_status = status_lines(s.view(), self.describe)

    def _fail(self, s: StepTurns, exc: BaseException) -> None:
        """With the lock held: abort the step with ``exc`` (the first failure wins), keeping
        ``status`` as it was when it failed, then release every thread."""
        self._keep(s, exc)
        s.wake_all()

    # ---- a step -------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], microbatches: Sequence[Microbatch],
            ops: tuple[Op, ...], next_forward: Sequence[int] | None = None,
            straight: Learned | None = None, learn_args: bool = False
            ) -> tuple[list[Any], list[bool]]:
        """Run ``fn`` once per microbatch while ``ops`` are executed in order; returns its results
        and whether each microbatch called ``model.backward``. ``straight``: run straight
        through, the forwards under these modes and with these arguments (``straight.py``);
        ``learn_args``: learn where each call's arguments come from (``last_maps``)."""
        m = len(microbatches)
        if straight is None and m > 1 and (self._pool is None or self._pool_size < m - 1):
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = ThreadPoolExecutor(m - 1, "smp-step"), m - 1
        grad, autocast = torch.is_grad_enabled(), autocast_state()
        s = StepTurns(ops, [Turn() for _ in range(m)],
                  [threading.Condition(self._lock) for _ in range(m)],
                  threading.Condition(self._lock), (fn, microbatches, grad, autocast),
                  threading.current_thread(), next_forward, [False] * m, [False] * m)
        self._step = s
        self.args_strayed = False
        s.learn_args = learn_args and straight is None
        if s.learn_args or (straight is not None and straight[1] is not None):
            s.pieces = [Pieces.of(mb) for mb in microbatches]
        if straight is not None:
            s.straight, s.arg_map = Request(None, *straight[0]), straight[1]
            return self._run_straight(s)
        results: list[Any] = [None] * m
        try:
            while True:  # the calling thread runs every microbatch nobody else started
                with self._lock:
                    j = next((k for k in range(m) if not s.started[k]), None)
                    if j is not None:
                        s.started[j] = True
                if j is None:
                    break
                try:
                    results[j] = self._user_thread(s, j)
                except _Aborted:
                    break
            with self._lock:
                self._drive(s, lambda: all(s.done) and s.next == len(s.ops), -1,
                            "every microbatch to finish")
            for mb, f in sorted(s.futures.items()):
                results[mb] = f.result(timeout=self.timeout_s)
            asked = [t.b_request is not None for t in s.turns]
            self.last_calls = _call_modes(s)
            self.last_maps = [t.arg_map for t in s.turns]
        except BaseException as exc:
            with self._lock:
                self._fail(s, exc)
            for f in list(s.futures.values()):
                with contextlib.suppress(BaseException):
                    f.result(timeout=self.timeout_s)
            raise (s.abort if s.abort is not None else exc) from None
        finally:
            with self._lock:
                self._last_abort = s.abort_status
                self._step = None
        return results, asked

    def _user_thread(self, s: StepTurns, mb: int) -> Any:
        fn, microbatches, grad, autocast = s.launch
        args, kwargs = microbatches[mb]
        context.enter_turn(self, mb)
        with self._lock:
            s.running += 1
        try:
            with thread_modes(grad, autocast):
                return fn(*args, **kwargs)
        except _Aborted:
            raise
        except BaseException as exc:
            with self._lock:
                self._fail(s, exc)
            raise
        finally:
            context.leave_turn()
            with self._lock:
                s.done[mb] = True
                s.running -= 1
                if s.holder == mb:
                    s.holder = None
                s.wake_main()
                if s.abort is None and self._may_drive(s, -2):
                    # this return may unblock the next op (a skipped backward): run it
                    with contextlib.suppress(_Aborted):
                        self._drive(s, lambda: not self._may_drive(s, -2), -2, "", lazy=True)
                if s.abort is None and threading.current_thread() is not s.main_thread:
                    self._start_needed(s)  # the calling thread may be asleep mid-function

    def _run_straight(self, s: StepTurns) -> tuple[list[Any], list[bool]]:
        """Every op in order on this thread, then the step functions not run yet (they ran
        when the transport would block, ``flush``, or before their backward decision). A
        step function's failure does not stop the ops, so this rank's peers get every
        message; it is raised after them."""
        m = len(s.turns)
        s.results = [None] * m
        self.ops_done = False
        try:
            s.driving = True
            for i, op in enumerate(s.ops):
                s.next = i
                if op.kind == "WAIT_B":  # the step function decides the backward
                    self._run_ready(s)
                self._execute(i, op)
            s.next, s.driving, self.ops_done = len(s.ops), False, True
            s.ready.extend(k for k in range(m) if not s.started[k] and k not in s.ready)
            self._run_ready(s)
            if s.abort is not None:
                raise s.abort
            missing = next((k for k, t in enumerate(s.turns) if t.f_request is None), None)
            if missing is not None:
                raise not_called(missing, self.rank)
            self.straight_steps += 1
            self.last_calls = _call_modes(s)
            return s.results, [t.b_request is not None for t in s.turns]
        except BaseException as exc:
            with self._lock:
                self._keep(s, exc)
            raise s.abort from None  # type: ignore[misc]
        finally:
            with self._lock:
                s.driving = False
                self._last_abort = s.abort_status
                self._step = None

    def _run_ready(self, s: StepTurns) -> None:
        """Run the step functions whose outputs are there, on this thread; a failure is kept
        (``abort``) for the step's end."""
        fn, microbatches, grad, autocast = s.launch
        while s.ready:
            mb = s.ready.pop(0)
            if s.started[mb]:
                continue
            s.started[mb] = True
            args, kwargs = microbatches[mb]
            context.enter_turn(self, mb)
            try:
                with thread_modes(grad, autocast):
                    s.results[mb] = fn(*args, **kwargs)
            except Exception as exc:  # raised after the ops (``_run_straight``)
                with self._lock:
                    self._keep(s, exc)
            finally:
                context.leave_turn()
                s.done[mb] = True

    def _start_needed(self, s: StepTurns) -> None:
        """With the lock held: start the step function the next op needs on a pool thread."""
        if s.driving or s.holder is not None or s.next >= len(s.ops):
            return
        op = s.ops[s.next]
        # a forward, or the receive a lazy driver stopped before (``_take_turn``): with
        # several stages on a rank the thread waiting for its outputs may be asleep
        if (op.kind == "F" or op.kind.startswith("RECV")) and not s.started[op.microbatch]:
            self._start(s, op.microbatch)

    def _start(self, s: StepTurns, j: int) -> None:
        """With the lock held: run microbatch ``j``'s step function on a pool thread."""
        s.started[j] = True
        self.threads_started += 1
        if self._pool is None:
            raise SMPInternalError.build("a step function needs a pool thread, but the step "
                                         "has one microbatch", j, f"rank {self.rank}")
        s.futures[j] = self._pool.submit(self._user_thread, s, j)



def _call_modes(s: StepTurns) -> list[Modes | None]:
    """The grad mode and autocast of each microbatch's ``model(...)`` call (None: none)."""
    return [None if t.f_request is None else (t.f_request.grad_enabled, t.f_request.autocast)
            for t in s.turns]
