"""The one executor: it interprets ``cost_model.schedule`` action lists.

Lowering (``lower``) turns a schedule into this rank's list of ``Op``s, adding the
communication each action needs (data, not code)::

    F(s, mb)  ->  RECV_ACT(s, mb, src)...  F(s, mb)  SEND_ACT(s, mb, dst)...  [SEND_OUT...]
    B(s, mb)  ->  [RECV_OUT(s, mb)]  WAIT_B(s, mb)  RECV_GRAD(s, mb, dst)...  B(s, mb)
                  SEND_GRAD(s, mb, src)...

Across processes a rank lowers its own stage's list. In-process (all stages here) the
stages' lists are merged in the lock-step order of ``cost_model.schedule.clock``, and the
last stage's outputs need no ``*_OUT`` ops.

Running a step: the user's step function runs once per microbatch, each in its own thread.
``model(...)`` posts an F request and ``model.backward(...)`` a B request, then wait. The
conductor (the calling thread) walks the op list strictly in order, waits for the request
an op needs, and does all computation and communication itself, so every rank issues its
sends and receives in schedule order. Grad mode and autocast captured from the requesting
thread apply to the work done for it. A failing user thread aborts the step: the conductor
re-raises its exception and every other thread is released.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from cost_model import schedule as sched
from cost_model.errors import SMPRuntimeError, SMPTimeoutError
from passes.split_stages import Stage, StagedProgram
from smp_fx.transport import Transport

OP_KINDS = ("RECV_ACT", "F", "SEND_ACT", "SEND_OUT", "RECV_OUT", "WAIT_B", "RECV_GRAD", "B",
            "SEND_GRAD")


@dataclass(frozen=True)
class Op:
    """One lowered step of a rank's work; ``peer`` is the other stage of a transfer."""

    kind: str
    stage: int
    microbatch: int
    peer: int = -1

    def __str__(self) -> str:
        peer = f"@{self.peer}" if self.peer >= 0 else ""
        return f"{self.stage}{self.kind}{self.microbatch}{peer}"


def lower(schedule: sched.Schedule, program: StagedProgram, stages: Sequence[int],
          multi_process: bool) -> tuple[Op, ...]:
    """This rank's op list for ``schedule`` over ``stages`` (one stage, or all in-process)."""
    p = len(schedule)
    last = p - 1
    if multi_process:
        (s,) = stages
        actions: list[sched.Action] = list(schedule[s])
    else:
        actions = [a for row in sched.clock(schedule) for a in row if a is not None]
    forward_only = all(a.kind == sched.FORWARD for a in actions)
    ops: list[Op] = []
    for a in actions:
        st = program.stages[a.stage]
        mb = a.microbatch
        if a.kind == sched.FORWARD:
            ops += [Op("RECV_ACT", a.stage, mb, src) for src, _ in st.recvs]
            ops.append(Op("F", a.stage, mb))
            ops += [Op("SEND_ACT", a.stage, mb, dst) for dst, _ in st.sends]
            if multi_process and a.stage == last:
                ops += [Op("SEND_OUT", a.stage, mb, d) for d in range(p) if d != last]
        else:
            if multi_process and a.stage != last:
                ops.append(Op("RECV_OUT", a.stage, mb, last))
            ops.append(Op("WAIT_B", a.stage, mb))
            ops += [Op("RECV_GRAD", a.stage, mb, dst) for dst, _ in st.sends]
            ops.append(Op("B", a.stage, mb))
            ops += [Op("SEND_GRAD", a.stage, mb, src) for src, _ in st.recvs]
    if multi_process and forward_only and stages[0] != last:
        ops += [Op("RECV_OUT", stages[0], mb, last) for mb in range(len(schedule[0]))]
    return tuple(ops)


class StageRunner:
    """Runs one stage's module: the seam where data parallelism wraps ``module``.

    The DDP work replaces ``module`` with a ``DistributedDataParallel`` wrapper and uses
    ``no_sync`` for all microbatches but the last; the executor only calls ``forward`` and
    ``backward`` here. On the last stage ``backward`` gets the user's loss tensors (and
    scaled grads): that one autograd pass runs through the loss into the stage.
    """

    def __init__(self, stage: Stage, device: torch.device) -> None:
        self.stage = stage
        self.module: torch.nn.Module = stage.module
        self.device = device

    def forward(self, inputs: Sequence[Any], microbatch: int) -> tuple[Any, ...]:
        return tuple(self.module(*inputs))

    def backward(self, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                 microbatch: int) -> None:
        torch.autograd.backward(tensors, grads)


@dataclass
class _Request:
    args: Any
    grad_enabled: bool
    autocast: tuple[tuple[str, torch.dtype], ...]


@dataclass
class _MbState:
    """Everything one microbatch holds on this rank during a step."""

    f_request: _Request | None = None
    b_request: _Request | None = None
    outputs: Any = None
    outputs_ready: bool = False
    backward_done: bool = False
    skip_backward: bool = False
    inputs: dict[int, dict[str, Any]] = field(default_factory=dict)     # stage -> name -> value
    results: dict[int, dict[str, Any]] = field(default_factory=dict)    # stage -> name -> value
    grads: dict[int, dict[str, list[Any]]] = field(default_factory=dict)
    send_grads: dict[int, dict[str, list[Any]]] = field(default_factory=dict)
    b_done: int = 0
    cut: Any = None  # the last stage's outputs as handed to the user
    used: Any = None  # (indices of output leaves that got a gradient, those that need one)


class _Aborted(BaseException):
    """Raised in user threads when the step aborts; BaseException so user code cannot eat it."""


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    out = []
    for dev in ("cpu", "cuda"):
        if torch.is_autocast_enabled(dev):
            out.append((dev, torch.get_autocast_dtype(dev)))
    return tuple(out)


@contextlib.contextmanager
def _thread_modes(grad_enabled: bool, autocast: tuple[tuple[str, torch.dtype], ...]) -> Any:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad_enabled))
        for dev, dtype in autocast:
            stack.enter_context(torch.autocast(dev, dtype=dtype))
        yield


_tls = threading.local()


def current() -> tuple[Executor, int] | None:
    """The (executor, microbatch) of the calling thread inside a step, else None."""
    return getattr(_tls, "ctx", None)


@dataclass
class StepStats:
    """What the last step did: peak microbatches holding saved state, per local stage."""

    peak_in_flight: dict[int, int] = field(default_factory=dict)
    ops: tuple[Op, ...] = ()


class Executor:
    """Interprets lowered schedules for the stages this rank holds.

    Turns are granted by position in the op list. Whichever thread is waiting when the next
    op can run (its microbatch's request has arrived, or it is a transfer) performs it, and
    keeps going while the following ops can run too: the "conductor" is a baton, not a
    thread, so a microbatch's own thread usually runs its own work with no thread switch.
    A driver that hands a result to another waiting thread stops there and lets that thread
    carry the baton, so only one thread runs Python at a time (no GIL convoys).
    Step functions start lazily: the calling thread runs each microbatch's function in turn
    and a pool thread starts one only when the next op needs a microbatch while its driver
    is stuck mid-function (a pipeline with several microbatches in flight). The calling
    thread drives what is left once every step function has returned.
    """

    def __init__(self, program: StagedProgram, runners: dict[int, StageRunner],
                 transport: Transport, multi_process: bool, timeout_s: float = 300.0,
                 rank: int = 0) -> None:
        self.program = program
        self.runners = runners
        self.transport = transport
        self.multi_process = multi_process
        self.timeout_s = timeout_s
        self.rank = rank
        self.last = program.num_stages - 1
        self.post_step_hooks: list[Callable[[], None]] = []
        # called with the step's ops before it runs; smp_fx.ddp needs it (issue 7): keep it
        self.pre_step_hooks: list[Callable[[tuple[Op, ...]], None]] = []
        self.stats = StepStats()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._lock = threading.Lock()
        self._conds: list[threading.Condition] = []
        self._main = threading.Condition(self._lock)
        self._mbs: list[_MbState] = []
        self._done: list[bool] = []
        self._ops: tuple[Op, ...] = ()
        self._next = 0
        self._driving = False
        self._handed_to = -1
        self._holder: int | None = None
        self._running = 0
        self._started: list[bool] = []
        self._futures: dict[int, Future[Any]] = {}
        self._launch: Any = None
        self._main_thread: threading.Thread | None = None
        self._abort: BaseException | None = None
        self._scale = 1.0
        self._lowered: dict[tuple[Any, ...], tuple[Op, ...]] = {}

    # ---- user-thread side -------------------------------------------------------------
    def forward_request(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        st = self._mbs[mb]
        with self._lock:
            if st.f_request is not None:
                raise SMPRuntimeError.build(
                    "the model may be called once per microbatch inside smp.step", mb,
                    f"rank {self.rank} microbatch {mb}", "call model(...) once per step fn")
            st.f_request = _Request((args, kwargs), torch.is_grad_enabled(), _autocast_state())
            self._drive(lambda: st.outputs_ready, mb, "its model outputs")
        return st.outputs

    def backward_request(self, mb: int, tensors: Any, grad_tensors: Any) -> None:
        st = self._mbs[mb]
        with self._lock:
            if st.f_request is None or st.b_request is not None:
                raise SMPRuntimeError.build(
                    "model.backward must follow model(...) and run once per microbatch", mb,
                    f"rank {self.rank} microbatch {mb}", "call model.backward(loss) once")
            st.b_request = _Request((tensors, grad_tensors), torch.is_grad_enabled(),
                                    _autocast_state())
            self._drive(lambda: st.backward_done, mb, "its backward pass")

    # ---- the baton ----------------------------------------------------------------------
    def _runnable(self, op: Op) -> bool:
        if op.kind == "F":
            return self._mbs[op.microbatch].f_request is not None or self._done[op.microbatch]
        if op.kind == "WAIT_B":
            st = self._mbs[op.microbatch]
            return st.b_request is not None or st.skip_backward or self._done[op.microbatch]
        return True

    def _may_drive(self, mb: int) -> bool:
        """Whether the thread of ``mb`` (< 0: the caller after its own work) runs the next op.

        Only when no other thread is driving or was just handed the baton, and, for a thread
        whose step function has returned, when no step function is running Python either.
        """
        return (not self._driving and self._holder is None and self._next < len(self._ops)
                and self._runnable(self._ops[self._next]) and (mb >= 0 or self._running == 0))

    def _drive(self, ready: Callable[[], bool], mb: int, what: str) -> None:
        """With the lock held: run ops while they can run, until ``ready()``; else sleep."""
        cond = self._conds[mb] if mb >= 0 else self._main
        if self._holder == mb:
            self._holder = None
        while True:
            if self._abort is not None:
                raise _Aborted()
            if ready():
                return
            ops = self._ops
            if self._may_drive(mb):
                self._driving = True
                try:
                    while self._next < len(ops) and self._runnable(ops[self._next]):
                        op = ops[self._next]
                        self._handed_to = -1
                        self._lock.release()
                        try:
                            getattr(self, "_op_" + op.kind.lower())(op)
                        finally:
                            self._lock.acquire()
                        self._next += 1
                        k = self._handed_to
                        if k not in (-1, mb) and not self._done[k]:
                            self._holder = k  # the woken thread carries on from here
                            break
                except BaseException as exc:
                    if self._abort is None and not isinstance(exc, _Aborted):
                        self._abort = exc
                    self._wake_all()
                    raise
                finally:
                    self._driving = False
                    self._main.notify_all()  # the caller may be waiting for the last op
                if ready():
                    return
            if mb < 0 and self._running == 0 and self._holder is None and all(self._done) \
                    and not self._driving and self._next < len(ops) \
                    and not self._may_drive(mb):
                raise SMPRuntimeError.build("the step cannot make progress",
                                            str(ops[self._next]), f"rank {self.rank}",
                                            "report this as an smp-fx bug")
            if mb >= 0:
                self._start_needed()
                self._running -= 1
                if self._running == 0:
                    self._main.notify_all()
            try:
                woke = cond.wait(self.timeout_s)
            finally:
                if mb >= 0:
                    self._running += 1
            if not woke:
                at = str(ops[self._next]) if self._next < len(ops) else "end of step"
                raise SMPTimeoutError.build(
                    f"timed out after {self.timeout_s:.0f}s waiting for {what}", at,
                    f"rank {self.rank} microbatch {mb if mb >= 0 else 'all'}",
                    "a peer rank may have failed (see its log), or the step function blocks")

    def _wake_all(self) -> None:
        for c in self._conds:
            c.notify_all()
        self._main.notify_all()

    def _publish(self, mb: int, **updates: Any) -> None:
        with self._lock:
            for k, v in updates.items():
                setattr(self._mbs[mb], k, v)
            self._handed_to = mb
            self._conds[mb].notify_all()

    # ---- a step -------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], microbatches: Sequence[tuple[tuple[Any, ...],
            dict[str, Any]]], schedule: sched.Schedule, scale: float) -> list[Any]:
        """Run ``fn`` once per microbatch under ``schedule``; return its results in order."""
        m = len(microbatches)
        stages = tuple(sorted(self.runners))
        key = (schedule, stages)
        if key not in self._lowered:
            self._lowered[key] = lower(schedule, self.program, stages, self.multi_process)
        ops = self._lowered[key]
        for pre in self.pre_step_hooks:
            pre(ops)
        self.stats = StepStats({s: 0 for s in stages}, ops)
        self._mbs = [_MbState() for _ in range(m)]
        self._done = [False] * m
        self._conds = [threading.Condition(self._lock) for _ in range(m)]
        self._ops, self._next, self._driving = ops, 0, False
        self._holder, self._running = None, 0
        self._abort = None
        self._scale = scale
        if m > 1 and (self._pool is None or self._pool_size < m - 1):
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = ThreadPoolExecutor(m - 1, "smp-step"), m - 1
        grad, autocast = torch.is_grad_enabled(), _autocast_state()
        self._started = [False] * m
        self._futures = {}
        self._launch = (fn, microbatches, grad, autocast)
        self._main_thread = threading.current_thread()
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
            self.transport.finish()
        except BaseException as exc:
            with self._lock:
                if self._abort is None:
                    self._abort = exc
                self._wake_all()
            for f in list(self._futures.values()):
                with contextlib.suppress(BaseException):
                    f.result(timeout=self.timeout_s)
            raise self._abort from None
        finally:
            self._mbs = []
        for hook in self.post_step_hooks:
            hook()
        return results

    def _user_thread(self, fn: Callable[..., Any], mb: int, args: tuple[Any, ...],
                     kwargs: dict[str, Any], grad: bool, autocast: Any) -> Any:
        _tls.ctx = (self, mb)
        with self._lock:
            self._running += 1
        try:
            with _thread_modes(grad, autocast):
                return fn(*args, **kwargs)
        except _Aborted:
            raise
        except BaseException as exc:
            with self._lock:
                if self._abort is None:
                    self._abort = exc
                self._wake_all()
            raise
        finally:
            _tls.ctx = None
            with self._lock:
                self._done[mb] = True
                self._running -= 1
                if self._holder == mb:
                    self._holder = None
                self._main.notify_all()
                if self._abort is None and self._may_drive(-2):
                    # this return may unblock the next op (a skipped backward): run it
                    with contextlib.suppress(_Aborted):
                        self._drive(lambda: not self._may_drive(-2), -2, "")
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
        j = op.microbatch
        if op.kind == "F" and not self._started[j]:
            self._started[j] = True
            fn, mbs, grad, autocast = self._launch
            assert self._pool is not None
            self._futures[j] = self._pool.submit(self._user_thread, fn, j, *mbs[j], grad,
                                                 autocast)

    def _request(self, mb: int, kind: str, stage: int) -> _Request | None:
        """Microbatch ``mb``'s F or B request; None if its thread returned without one."""
        st = self._mbs[mb]
        req = st.f_request if kind == "F" else st.b_request
        if req is None and kind == "F":
            raise SMPRuntimeError.build(
                "the smp.step function returned without calling the DistributedModel",
                f"microbatch {mb}", f"rank {self.rank} stage {stage}",
                "call model(...) inside every smp.step function")
        return req

    def _op_recv_act(self, op: Op) -> None:
        vals = self.transport.recv(op.peer, op.stage, "act", op.microbatch)
        names = dict(self.program.stages[op.stage].recvs)[op.peer]
        self._mbs[op.microbatch].inputs.setdefault(op.stage, {}).update(zip(names, vals))

    def _op_f(self, op: Op) -> None:
        mb, s = op.microbatch, op.stage
        req = self._request(mb, "F", s)
        assert req is not None
        st, runner, stage = self._mbs[mb], self.runners[s], self.program.stages[s]
        received = st.inputs.setdefault(s, {})
        if stage.program_inputs:
            bound = self.program.bind_inputs(*req.args)
            for name in stage.program_inputs:
                received[name] = pytree.tree_map_only(
                    torch.Tensor, lambda t: t.to(runner.device), bound[name])
        with _thread_modes(req.grad_enabled, req.autocast):
            outs = runner.forward([received[n] for n in stage.input_names], mb)
        st.results[s] = dict(zip(stage.output_names, outs))
        if req.grad_enabled:
            self.stats.peak_in_flight[s] = max(
                self.stats.peak_in_flight[s],
                sum(1 for x in self._mbs if s in x.results and not x.backward_done))
        if s == self.last:
            # The user's loss graph hangs off these very tensors, so model.backward(loss)
            # reaches the stage in one autograd pass; a hook per output records which ones
            # the loss used (an unused one is an error, as in SMP).
            got: set[int] = set()
            need = []
            for i, t in enumerate(pytree.tree_leaves(outs)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(_mark_used, got, i))
                    need.append(i)
            st.cut, st.used = outs, (got, need)
            self._publish(mb, outputs=self.program.build_outputs(outs), outputs_ready=True)
        if not req.grad_enabled:
            st.inputs.pop(s, None)

    def _op_send_act(self, op: Op) -> None:
        names = dict(self.program.stages[op.stage].sends)[op.peer]
        res = self._mbs[op.microbatch].results[op.stage]
        self.transport.send(tuple(res[n] for n in names), op.stage, op.peer, "act",
                            op.microbatch)

    def _op_send_out(self, op: Op) -> None:
        self.transport.send(self._mbs[op.microbatch].cut, op.stage, op.peer, "out",
                            op.microbatch)

    def _op_recv_out(self, op: Op) -> None:
        st = self._mbs[op.microbatch]
        if st.outputs_ready:
            return
        cut = self.transport.recv(op.peer, op.stage, "out", op.microbatch)
        st.cut = cut
        self._publish(op.microbatch, outputs=self.program.build_outputs(cut), outputs_ready=True)

    def _op_wait_b(self, op: Op) -> None:
        st = self._mbs[op.microbatch]
        if st.b_request is None:
            st.skip_backward = True

    def _op_recv_grad(self, op: Op) -> None:
        st = self._mbs[op.microbatch]
        if st.skip_backward:
            return
        grads = self.transport.recv(op.peer, op.stage, "grad", op.microbatch)
        names = dict(self.program.stages[op.stage].sends)[op.peer]
        acc = st.grads.setdefault(op.stage, {})
        for name, g in zip(names, grads):
            acc.setdefault(name, []).append(g)

    def _op_b(self, op: Op) -> None:
        mb, s = op.microbatch, op.stage
        st = self._mbs[mb]
        if st.skip_backward:
            self._finish_backward(mb, s)
            return
        req = st.b_request
        assert req is not None
        runner = self.runners[s]
        results = st.results.get(s, {})
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if s == self.last:
            self._loss_backward(mb, req, runner)  # through the user's loss into the stage
            got, need = st.used
            self._check_used([i for i in need if i not in got])
        else:
            for name, glist in st.grads.get(s, {}).items():
                leaves = pytree.tree_leaves(results[name])
                for i, t in enumerate(leaves):
                    gs = [g[i] for g in glist if g[i] is not None]
                    if gs and isinstance(t, torch.Tensor) and t.requires_grad:
                        tensors.append(t)
                        grads.append(gs[0] if len(gs) == 1 else torch.stack(gs).sum(0))
        if tensors:
            with _thread_modes(True, req.autocast):
                runner.backward(tensors, grads, mb)
        self._finish_backward(mb, s)

    def _finish_backward(self, mb: int, s: int) -> None:
        """Keep the grads to send, free the stage's saved state, release the user thread."""
        st = self._mbs[mb]
        inputs = st.inputs.pop(s, {})
        if not st.skip_backward:
            st.send_grads[s] = {
                n: [t.grad if isinstance(t, torch.Tensor) else None
                    for t in pytree.tree_leaves(inputs[n])]
                for _, names in self.program.stages[s].recvs for n in names}
        st.results.pop(s, None)
        st.grads.pop(s, None)
        st.b_done += 1
        if st.b_done == len(self.runners):
            self._publish(mb, backward_done=True)

    def _op_send_grad(self, op: Op) -> None:
        st = self._mbs[op.microbatch]
        if st.skip_backward:
            return
        names = dict(self.program.stages[op.stage].recvs)[op.peer]
        grads = st.send_grads[op.stage]
        self.transport.send(tuple(grads[n] for n in names), op.stage, op.peer, "grad",
                            op.microbatch)

    def _loss_backward(self, mb: int, req: _Request, runner: StageRunner) -> None:
        tensors, grad_tensors = req.args
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if grad_tensors is None:
            gs: list[Any] = [None] * len(ts)
        elif isinstance(grad_tensors, torch.Tensor):
            gs = [grad_tensors]
        else:
            gs = list(grad_tensors)
        scaled = []
        for t, g in zip(ts, gs):
            if g is None:
                if t.numel() != 1:
                    raise SMPRuntimeError.build(
                        "model.backward needs grad_tensors for a non-scalar tensor",
                        tuple(t.shape), f"rank {self.rank} microbatch {mb}",
                        "pass grad_tensors, or call backward on a scalar loss")
                g = torch.ones_like(t)
            scaled.append(g * self._scale if self._scale != 1.0 else g)
        with _thread_modes(True, req.autocast):
            runner.backward(ts, scaled, mb)  # the seam (DDP) sees the last stage's pass too

    def _check_used(self, unused: list[int]) -> None:
        if unused:
            raise SMPRuntimeError.build(
                "the argument to smp.DistributedModel.backward() must depend on all "
                "model outputs", f"output leaf {unused[0]} of model(...) got no gradient",
                f"rank {self.rank}",
                "use every output in the loss, or do not return it from forward")


def _mark_used(got: set[int], index: int, grad: torch.Tensor) -> None:
    got.add(index)
