"""The one executor: it interprets ``cost_model.schedule`` action lists.

Lowering (``lower``) turns a schedule into this rank's list of ``Op``s, adding the
communication each action needs (data, not code)::

    F(s, mb)  ->  RECV_ACT(s, mb, src)...  F(s, mb)  SEND_ACT(s, mb, dst)...
    B(s, mb)  ->  [WAIT_B(s, mb)]  RECV_GRAD(s, mb, dst)...  B(s, mb)  SEND_GRAD(s, mb, src)...

Whether a microbatch's backward runs is the step function's decision (it calls
``model.backward`` or not), taken where the loss is: ``WAIT_B`` waits for it on the last
stage (and on a stage that sends nothing on). Every other stage learns it from the
gradient messages (``(None, ...)`` when skipped), so its backward never waits for its own
step function; that the step function decided alike is checked at the end of the step.
(A stage that sends nothing on, whose results only feed unused values, gets no gradient
messages: it gets the outputs on their own channel and waits like the last stage.)

Across processes the last stage's outputs reach every other rank riding on the gradient
messages, ``(grads, outputs)``, relayed stage by stage: a ``model(...)`` call off the last
stage returns when its microbatch's gradients arrive, just before that stage's backward,
and the outputs cost no message of their own on the busiest rank. A forward-only step has
no gradients: there the last stage sends them on their own channel, ``SEND_OUT`` after each
forward and ``RECV_OUT`` at the end of the other ranks' lists.

Across processes a rank lowers its own stage's list. In-process (all stages here) the
stages' lists are merged in the lock-step order of ``cost_model.schedule.clock``, and the
last stage's outputs need no ``*_OUT`` ops.

Running a step: ``smp_fx.runtime.conductor`` runs the step function once per microbatch and grants
turns in op order; ``Executor._execute`` performs each op (stage forward/backward through
its ``StageRunner``, transfers through the ``Transport``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from cost_model import schedule as sched
from cost_model.errors import SMPRuntimeError
from passes.split_stages import Stage, StagedProgram
from smp_fx.runtime.conductor import (
    Conductor,
    _next_forwards,
    _Request,
    _thread_modes,
)
from smp_fx.runtime.transport import Transport

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
    # who gets the last stage's outputs on their own channel: every rank in a forward-only
    # step; else only a stage that sends nothing on, so no gradient message reaches it
    out_to = [d for d in range(p) if d != last and (forward_only or not
                                                      program.stages[d].sends)]
    ops: list[Op] = []
    for a in actions:
        st = program.stages[a.stage]
        mb = a.microbatch
        if a.kind == sched.FORWARD:
            ops += [Op("RECV_ACT", a.stage, mb, src) for src, _ in st.recvs]
            ops.append(Op("F", a.stage, mb))
            ops += [Op("SEND_ACT", a.stage, mb, dst) for dst, _ in st.sends]
            if multi_process and a.stage == last:
                ops += [Op("SEND_OUT", a.stage, mb, d) for d in out_to]
        else:
            if multi_process and a.stage in out_to:
                ops.append(Op("RECV_OUT", a.stage, mb, last))
            if a.stage == last or not st.sends:
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


@dataclass(frozen=True)
class _Lowered:
    """A schedule lowered for this rank, with what every step of it needs: the ops, where
    each receive stream is announced (``_receive_posts``), how many messages each send
    stream carries, the position of the last receive, and the next forward's microbatch
    per position (``ahead`` ranks only)."""

    ops: tuple[Op, ...]
    posts: dict[int, list[tuple[int, int, str, int]]]
    sends: dict[tuple[int, int, str], int]  # (stage, peer, channel) -> messages per step
    last_recv: int
    next_forward: list[int] | None


@dataclass
class StepStats:
    """What the last step did: peak microbatches holding saved state, per local stage."""

    peak_in_flight: dict[int, int] = field(default_factory=dict)
    ops: tuple[Op, ...] = ()


class Executor(Conductor):
    """Interprets lowered schedules for the stages this rank holds (see the module doc)."""

    def __init__(self, program: StagedProgram, runners: dict[int, StageRunner],
                 transport: Transport, multi_process: bool, timeout_s: float = 300.0,
                 rank: int = 0) -> None:
        super().__init__(timeout_s, rank)
        self.program = program
        self.runners = runners
        self.transport = transport
        transport.on_block = self._flush  # held-back step functions run while it waits
        self.multi_process = multi_process
        self.last = program.num_stages - 1
        self.post_step_hooks: list[Callable[[], None]] = []
        # called with the step's ops before it runs; smp_fx.dist.ddp needs it (issue 7): keep it
        self.pre_step_hooks: list[Callable[[tuple[Op, ...]], None]] = []
        self.stats = StepStats()
        self._scale = 1.0
        self._lowered: dict[tuple[Any, ...], _Lowered] = {}
        self._step = _Lowered((), {}, {}, -1, None)  # the running (or last) step's
        self._step_key: tuple[Any, ...] = (None, None)  # its (schedule, stages)
        # the value names each (stage, peer) transfer carries
        self._send_names = {(s, d): names for s, st in enumerate(program.stages)
                            for d, names in st.sends}
        self._recv_names = {(s, d): names for s, st in enumerate(program.stages)
                            for d, names in st.recvs}

    def run(self, fn: Callable[..., Any], microbatches: Sequence[tuple[tuple[Any, ...],
            dict[str, Any]]], schedule: sched.Schedule, scale: float) -> list[Any]:
        """Run ``fn`` once per microbatch under ``schedule``; return its results in order."""
        stages = tuple(sorted(self.runners))
        key = (schedule, stages)
        # the schedule is usually the very object of the last step (hashing one hashes
        # every action)
        same = self._step_key[0] is schedule and self._step_key[1] == stages
        step = self._step if same else self._lowered.get(key)
        if step is None:
            ops = lower(schedule, self.program, stages, self.multi_process)
            last_recv = max((i for i, op in enumerate(ops) if op.kind.startswith("RECV")),
                            default=-1)
            # A rank without the last stage waits for remote outputs in every model(...)
            # call: it starts step functions a forward ahead.
            ahead = self.multi_process and self.last not in self.runners
            step = self._lowered[key] = _Lowered(
                ops, _receive_posts(ops), _send_counts(ops), last_recv,
                _next_forwards(ops) if ahead else None)
        self._step, self._step_key = step, key
        for (stage, peer, channel), n in step.sends.items():
            self.transport.plan_sends(stage, peer, channel, n)
        for pre in self.pre_step_hooks:
            pre(step.ops)
        self.stats = StepStats({s: 0 for s in stages}, step.ops)
        self._scale = scale
        results = self._run_step(fn, microbatches, step.ops, step.next_forward)
        for hook in self.post_step_hooks:
            hook()
        return results

    def _execute(self, op: Op) -> None:
        for peer, stage, channel, n in self._step.posts.get(self._next, ()):
            self.transport.prefetch(peer, stage, channel, n)
        getattr(self, "_op_" + op.kind.lower())(op)

    def _op_recv_act(self, op: Op) -> None:
        vals = self.transport.recv(op.peer, op.stage, "act", op.microbatch)
        names = self._recv_names[(op.stage, op.peer)]
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
                received[name] = _to_device(bound[name], runner.device)
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
            for i, t in enumerate(_leaves(outs)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(_mark_used, got, i))
                    need.append(i)
            st.cut, st.used = outs, (got, need)
            self._publish(mb, outputs=self.program.build_outputs(outs), outputs_ready=True)
        if not req.grad_enabled:
            st.inputs.pop(s, None)

    def _op_send_act(self, op: Op) -> None:
        names = self._send_names[(op.stage, op.peer)]
        res = self._mbs[op.microbatch].results[op.stage]
        self.transport.send(tuple(res[n] for n in names), op.stage, op.peer, "act",
                            op.microbatch)

    def _op_send_out(self, op: Op) -> None:
        self.transport.send(self._mbs[op.microbatch].cut, op.stage, op.peer, "out",
                            op.microbatch)

    def _op_recv_out(self, op: Op) -> None:
        self._deliver_outputs(op.microbatch,
                              self.transport.recv(op.peer, op.stage, "out", op.microbatch))

    def _deliver_outputs(self, mb: int, cut: Any, defer: bool = False) -> None:
        """The last stage's outputs, received on this rank: to microbatch ``mb``'s thread."""
        self._mbs[mb].cut = cut
        self._publish(mb, hand=False, defer=defer, outputs=self.program.build_outputs(cut),
                      outputs_ready=True)

    def _op_wait_b(self, op: Op) -> None:
        st = self._mbs[op.microbatch]
        st.skip[op.stage] = st.b_request is None

    def _op_recv_grad(self, op: Op) -> None:
        st = self._mbs[op.microbatch]
        grads, cut = self.transport.recv(op.peer, op.stage, "grad", op.microbatch)
        if cut is not None and st.cut is None:  # the last stage's outputs, relayed
            # held back until this rank would wait, unless it will not wait again this step
            self._deliver_outputs(op.microbatch, cut, defer=self._next != self._step.last_recv)
        skipped = grads is None
        if st.skip.setdefault(op.stage, skipped) != skipped:
            _inconsistent(op, "the gradient messages from later stages disagree (stage "
                              f"{op.peer}'s rank {'skipped' if skipped else 'ran'} it)")
        if skipped:
            return
        names = self._send_names[(op.stage, op.peer)]
        acc = st.grads.setdefault(op.stage, {})
        for name, g in zip(names, grads):
            acc.setdefault(name, []).append(g)

    def _op_b(self, op: Op) -> None:
        mb, s = op.microbatch, op.stage
        st = self._mbs[mb]
        if st.skip[s]:
            self._finish_backward(mb, s)
            return
        # Off the last stage the step function may not have asked yet (see the module doc).
        req = st.b_request or st.f_request
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
                leaves = _leaves(results[name])
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
        if not st.skip[s]:
            st.send_grads[s] = {
                n: [t.grad if isinstance(t, torch.Tensor) else None
                    for t in _leaves(inputs[n])]
                for _, names in self.program.stages[s].recvs for n in names}
        st.results.pop(s, None)
        st.grads.pop(s, None)
        st.b_done += 1
        if st.b_done == len(self.runners):
            self._publish(mb, hand=False, backward_done=True)

    def _op_send_grad(self, op: Op) -> None:
        st = self._mbs[op.microbatch]
        grads = None  # skipped: the receiver still expects the message (and the outputs)
        if not st.skip[op.stage]:
            names = self._recv_names[(op.stage, op.peer)]
            grads = tuple(st.send_grads[op.stage][n] for n in names)
        self.transport.send((grads, st.cut if self.multi_process else None), op.stage, op.peer,
                            "grad", op.microbatch)

    def _check_step(self) -> None:
        """A stage whose backward followed the gradient messages: its step function must
        have decided alike (the last stage's rank saw the same outputs)."""
        for mb, st in enumerate(self._mbs):
            for s, skipped in st.skip.items():
                if skipped == (st.b_request is not None):
                    _inconsistent(Op("B", s, mb),
                                  f"this rank's step function {'did' if skipped else 'did not'}"
                                  " call it, yet the gradient messages say the backward was "
                                  f"{'skipped' if skipped else 'run'}")

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
                scaled.append(torch.full_like(t, self._scale))
            else:
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


def _to_device(value: Any, device: torch.device) -> Any:
    """``value``'s tensors on ``device`` (a plain tensor already there, the usual model
    input, skips the pytree walk)."""
    if type(value) is torch.Tensor and value.device == device:
        return value
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def _leaves(value: Any) -> list[Any]:
    """``pytree.tree_leaves`` with fast paths for a tensor and a tuple of tensors."""
    if type(value) is torch.Tensor:
        return [value]
    if type(value) is tuple and all(type(v) is torch.Tensor for v in value):
        return list(value)
    return pytree.tree_leaves(value)


_CHANNEL = {"RECV_ACT": "act", "SEND_ACT": "act", "RECV_GRAD": "grad", "SEND_GRAD": "grad",
            "RECV_OUT": "out", "SEND_OUT": "out"}  # the transport channel of a transfer op


def _receive_posts(ops: Sequence[Op]) -> dict[int, list[tuple[int, int, str, int]]]:
    """Where each stream of messages ``ops`` receive is announced to the transport
    (``prefetch``: its receives are then kept posted ahead): op position -> (peer, stage,
    channel, how many messages this step).

    Before the stream's first receive, or right after this rank's first send if that comes
    earlier: no peer sends this rank anything that depends on this rank's work before this
    rank has sent something, so that is early enough. It keeps receives off the start of
    the step, where posting one right after the previous step's end can stall for
    milliseconds under gloo, and off the first send's path, which is the pipeline's fill
    (measured: posting first delayed the first stage's first activation by ~0.1 ms)."""
    channel = {k: c for k, c in _CHANNEL.items() if k.startswith("RECV")}
    first_send = next((i for i, op in enumerate(ops) if op.kind.startswith("SEND")), len(ops))
    streams: dict[tuple[int, int, str], list[int]] = {}
    for i, op in enumerate(ops):
        if op.kind in channel:
            streams.setdefault((op.peer, op.stage, channel[op.kind]), []).append(i)
    posts: dict[int, list[tuple[int, int, str, int]]] = {}
    for key, where in streams.items():
        posts.setdefault(min(where[0], first_send + 1), []).append((*key, len(where)))
    return posts


def _send_counts(ops: Sequence[Op]) -> dict[tuple[int, int, str], int]:
    """How many messages ``ops`` send per (stage, peer, channel): the transport's receiver
    counts the same stream from its own ops (``prefetch``)."""
    counts: dict[tuple[int, int, str], int] = {}
    for op in ops:
        if op.kind.startswith("SEND"):
            key = (op.stage, op.peer, _CHANNEL[op.kind])
            counts[key] = counts.get(key, 0) + 1
    return counts


def _inconsistent(op: Op, what: str) -> None:
    raise SMPRuntimeError.build(
        "every pipeline rank must call model.backward for the same microbatches", what,
        f"stage {op.stage} microbatch {op.microbatch}",
        "take the decision to call model.backward the same way on every rank (it may "
        "depend on the model outputs, which every rank sees)")


def _mark_used(got: set[int], index: int, grad: torch.Tensor) -> None:
    got.add(index)
