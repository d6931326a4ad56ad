"""The one executor: it performs the ops of lowered ``cost_model.schedule`` action lists.

``smp_fx.runtime.executor.lowering`` turns a schedule into this rank's ops; the executor holds a
``Conductor``, which runs the step function once per microbatch and grants turns in op
order, and performs each op when its turn comes (``_execute``): stage forward and
backward through the stage's ``StageRunner``, transfers through the ``Transport``. Every
value a microbatch holds on this rank during a step (received inputs, stage results,
gradients) is the executor's (``MbData``); the conductor sees requests and outputs only.

A rank may hold several stages (chunks of the model, ``virtual_pipeline_degree``): each has
its runner, and a transfer between two of them stays in this process (``_via``: a mailbox of
its own). A split backward (``pipeline`` ``zero_bubble`` or ``zbv``) runs as an ``I`` op,
which computes the stage's input gradients only and sends them on
(``StageRunner.backward_input``, ``smp_fx.runtime.executor.split_backward``), and a later ``W`` op,
which computes its weight gradients from the graph the I kept (``backward_weight``); a
microbatch's backward on the rank is done after its last B or W.

Whether a microbatch's backward runs is the step function's decision (it calls
``model.backward`` or not), taken where the loss is: ``WAIT_B`` waits for it on the last
stage (and on a stage that sends nothing on). Every other stage learns it from the
gradient messages (``(None, ...)`` when skipped), so its backward never waits for its own
step function; that the step function decided alike is checked at the end of the step.

Across processes the last stage's outputs reach every other rank riding on the gradient
messages, ``(grads, outputs)``, relayed stage by stage: a ``model(...)`` call off the last
stage returns when its microbatch's gradients arrive, just before that stage's backward,
and the outputs cost no message of their own on the busiest rank. A forward-only step has
no gradients: there they travel on their own channel (``SEND_OUT``/``RECV_OUT``).

The outputs a rank sends on are the values the last stage produced, whatever the step
function does with its own: the last stage sends a copy taken at its forward (its step
function holds the real outputs, which its loss's autograd graph needs), and every other
rank hands its step function a copy of what it received (an autograd-tracked clone where
the value requires grad). So a step function may modify its outputs in place, as the
Hugging Face Trainer's does (``loss /= gradient_accumulation_steps``), on every rank.
Each step is recorded in a ``FlightRecorder`` (``smp_fx.runtime.executor.flight``): the start of
every op, told with the step's state when the step fails on a peer or stalls, and the words
the transport's errors use to say what this rank was doing.

Everything else the executor holds during a step (its lowering, the loss scale, the values
of every microbatch, the offloaded activations' prefetch points, the statistics) is one
``StepRun``, made for each step and dropped after it; what the executor keeps between steps
is what it was built with and the lowering cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cost_model import schedule as sched
from cost_model.errors import SMPInternalError, SMPRuntimeError
from passes.split_stages import StagedProgram
from smp_fx.runtime.executor.conductor import Conductor
from smp_fx.runtime.executor.flight import FlightRecorder
from smp_fx.runtime.executor.lowering import LoweredCache, Op
from smp_fx.runtime.executor.modes import autocast_state, thread_modes
from smp_fx.runtime.executor.seams import PostStep, PreStep, StageRunner
from smp_fx.runtime.executor.step_data import MbData, StepRun, StepStats
from smp_fx.runtime.executor.step_log import StepLog
from smp_fx.runtime.executor.stragglers import StragglerWatch, split_step
from smp_fx.runtime.executor.straight import ModeMemo
from smp_fx.runtime.executor.turns import Microbatch, Request
from smp_fx.runtime.memory.activations import ActivationKeeper, prefetch_points
from smp_fx.runtime.transport.transport import InProcessTransport, Transport
from smp_fx.runtime.transport.values import leaves, sent_copy, to_device, user_copy


@dataclass(frozen=True)
class ExecutorOptions:
    """How this rank's executor runs, fixed at construction.

    ``multi_process``: each stage in a process of its own (else every stage in this one);
    ``stage_ranks``: the global rank of each stage's process (multi-process only);
    ``loading_horizon``: ``activation_loading_horizon``, how far ahead offloaded
    activations come back."""

    multi_process: bool
    timeout_s: float = 300.0
    rank: int = 0
    stage_ranks: tuple[int, ...] | None = None
    loading_horizon: int = 4


class Executor:
    """Performs lowered schedules for the stages this rank holds (see the module doc).

    Everything it runs with is given at construction: the stage runners (data parallelism
    may have wrapped them), the activation keepers, the received-shape check and the step
    hooks, in the order ``smp_fx.parallel.build`` composed them; nothing is added later.
    """

    def __init__(self, program: StagedProgram, runners: Mapping[int, StageRunner],
                 transport: Transport, options: ExecutorOptions, *,
                 keepers: Mapping[int, ActivationKeeper] | None = None,
                 check_received: Callable[..., None] | None = None,
                 pre_step_hooks: Sequence[PreStep] = (),
                 post_step_hooks: Sequence[PostStep] = (),
                 stragglers: StragglerWatch | None = None) -> None:
        self.program = program
        self.runners: Mapping[int, StageRunner] = dict(runners)
        self.transport = transport
        self.options = options
        self.multi_process = options.multi_process
        self.rank = options.rank
        timeout_s = options.timeout_s
        self.flight = FlightRecorder(options.rank, sorted(runners), options.stage_ranks,
                                     timeout_s)
        self.conductor = Conductor(self._execute, timeout_s, options.rank,
                                   self.flight.describe)
        self.flight.status, self.flight.busy = self.conductor.status, self.conductor.performing
        transport.on_block = self.conductor.flush  # held-back step functions run meanwhile
        self.conductor.on_straight_call = self._check_late
        self._modes = ModeMemo()  # the modes straight steps' forwards take
        transport.where = self.flight.where
        if options.multi_process:
            self.flight.watch()  # a stalled step is told even if this rank waits on no peer
        self.last = program.num_stages - 1
        self.pre_step_hooks: tuple[PreStep, ...] = tuple(pre_step_hooks)
        self.post_step_hooks: tuple[PostStep, ...] = tuple(post_step_hooks)
        self.stragglers = stragglers  # told each step's split (smp_fx.runtime.executor.stragglers)
        self.stats = StepStats()
        self.step_log = StepLog()  # each step's time per op (smp.write_measurement)
        # checks a stage's received values against this rank's model call before its
        # forward: (stage, received values by name, rank, call args, call kwargs)
        self.check_received = check_received
        # per stage: saved-tensor hooks that count and offload what a forward keeps
        self.keepers: Mapping[int, ActivationKeeper] = dict(keepers or {})
        self.loading_horizon = options.loading_horizon
        self._lowerings = LoweredCache(program, options.multi_process)
        # transfers between two stages of this rank stay here (chunks of one rank)
        self._local: Transport = (InProcessTransport({s: r.device for s, r in runners.items()})
                                  if options.multi_process else transport)
        self._run: StepRun | None = None  # the running step's
        # the value names each (stage, peer) transfer carries
        self._send_names = {(s, d): names for s, st in enumerate(program.stages)
                            for d, names in st.sends}
        self._recv_names = {(s, d): names for s, st in enumerate(program.stages)
                            for d, names in st.recvs}

    def run(self, fn: Callable[..., Any], microbatches: Sequence[Microbatch],
            schedule: sched.Schedule, scale: float) -> list[Any]:
        """Run ``fn`` once per microbatch under ``schedule``; return its results in order.

        ``schedule`` should come from ``lowering.cached_schedule``: the lowering cache then
        finds the step's ops by identity (``LoweredCache.get``)."""
        stages = tuple(sorted(self.runners))
        step = self._lowerings.get(schedule, stages)
        for (stage, peer, channel), n in step.sends.items():
            self.transport.plan_sends(stage, peer, channel, n)
        for pre in self.pre_step_hooks:
            pre(step.ops)
        prefetch: dict[int, list[tuple[int, int]]] = {}
        for s, keeper in self.keepers.items():
            if keeper.offload:
                for i, mbs in prefetch_points(step.ops, s, self.loading_horizon).items():
                    prefetch.setdefault(i, []).extend((s, mb) for mb in mbs)
        self.stats = StepStats({s: 0 for s in stages}, step.ops)
        self.step_log.note_inputs(microbatches, autocast_state())
        run = self._run = StepRun(step, scale, [MbData() for _ in microbatches], prefetch,
                                   self.stats)
        self.flight.begin(step.ops)
        launch = (torch.is_grad_enabled(), autocast_state())
        straight = self._modes.get(fn, launch) if step.straight else None
        if straight is not None and step.takes_args and straight[1] is None:
            straight = None  # where its arguments come from was not learned
        learn = step.straight and not self._modes.known(fn, launch)
        late: Exception | None = None  # a failure after every op: raised after the hooks
        try:
            try:
                results, asked = self.conductor.run(fn, microbatches, step.ops,
                                                    step.next_forward, straight,
                                                    learn and step.takes_args)
            except Exception as exc:
                if straight is None or not self.conductor.ops_done:
                    raise
                late, results, asked = exc, [], []
                if self.conductor.args_strayed:
                    self._modes.forget(fn, launch)
            if learn:
                self._modes.learn(fn, launch, self.conductor.last_calls,
                                  self.conductor.last_maps if step.takes_args else ())
            self.flight.mark(len(step.ops))
            self.transport.finish()
            if late is None:
                late = self._check_step(run, asked)  # after finish: ready for the next
        except BaseException as exc:
            self.transport.abandon(f"a step failed on rank {self.options.rank} "
                                   f"({type(exc).__name__})")
            self.flight.failed(exc)
            raise
        finally:
            self._run = None
            self.flight.end()
            for keeper in self.keepers.values():
                keeper.end_step()
        if late is not None:  # the peers finished this step: so does this rank's collectives
            self.flight.failed(late)
        ended = time.monotonic()
        for hook in self.post_step_hooks:
            hook()
        hooks_s = time.monotonic() - ended
        split = split_step(self.flight, ended, hooks_s)  # one pass over the step's ops
        self.step_log.step_done(self.flight, split)
        if self.stragglers is not None:
            self.stragglers.step_done(self.flight, split)
        if late is not None:
            raise late
        return results

    def _execute(self, i: int, op: Op) -> None:
        """Perform op ``i`` of the step (the conductor's ``execute``)."""
        run = self._run
        if run is None:
            raise SMPInternalError.build("an op was performed outside a step", str(op),
                                         f"rank {self.rank}")
        posts = run.lowered.posts.get(i)
        if posts:
            for peer, stage, channel, n in posts:
                self.transport.prefetch(peer, stage, channel, n)
        run.at = i
        self.flight.mark(i)
        for s, mb in run.prefetch.get(i, ()):
            self.keepers[s].prefetch(mb)
        getattr(self, "_op_" + op.kind.lower())(run, op)

    def _via(self, peer: int) -> Transport:
        """The transport to stage ``peer``: this process's mailbox for a local stage."""
        return self._local if peer in self.runners else self.transport

    def _op_recv_act(self, run: StepRun, op: Op) -> None:
        vals = self._via(op.peer).recv(op.peer, op.stage, "act", op.microbatch)
        names = self._recv_names[(op.stage, op.peer)]
        run.data[op.microbatch].inputs.setdefault(op.stage, {}).update(zip(names, vals))

    def _op_f(self, run: StepRun, op: Op) -> None:
        mb, s = op.microbatch, op.stage
        req = self.conductor.forward_of(mb, s)
        d, runner, stage = run.data[mb], self.runners[s], self.program.stages[s]
        received = d.inputs.setdefault(s, {})
        if stage.program_inputs:
            bound = self.program.bind_inputs(*req.args)
            for name in stage.program_inputs:
                received[name] = to_device(bound[name], runner.device)
        if self.check_received is not None and stage.recvs:
            if req.args is None:  # a straight step: at its model(...) call (_check_late)
                d.late_checks.append((s, {n: torch.empty(v.shape, device="meta")
                                          for n, v in received.items()
                                          if isinstance(v, torch.Tensor)}))
            else:
                self.check_received(s, received, self.rank, *req.args)
        keeper = self.keepers.get(s)
        with thread_modes(req.grad_enabled, req.autocast), \
                keeper.forward(mb) if keeper is not None else contextlib.nullcontext():
            outs = runner.forward([received[n] for n in stage.input_names], mb)
        d.results[s] = dict(zip(stage.output_names, outs))
        if req.grad_enabled:
            run.stats.peak_in_flight[s] = max(
                run.stats.peak_in_flight[s],
                sum(1 for x in run.data if s in x.results or s in x.pending))
        if s == self.last:
            # The user's loss graph hangs off these very tensors, so model.backward(loss)
            # reaches the stage in one autograd pass. An output off the loss's path (a
            # cache, an integer tensor) gets no gradient, as in plain autograd.
            d.cut = sent_copy(outs) if self.multi_process else outs
            self.conductor.publish_outputs(mb, self.program.build_outputs(outs))
        if not req.grad_enabled:
            d.inputs.pop(s, None)

    def _check_late(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A straight step's received shapes against its ``model(...)`` call, which came
        after the forwards (a mismatch fails the step after its ops)."""
        run = self._run
        if run is not None and self.check_received is not None:
            for s, shapes in run.data[mb].late_checks:
                self.check_received(s, shapes, self.rank, args, kwargs)

    def _op_send_act(self, run: StepRun, op: Op) -> None:
        names = self._send_names[(op.stage, op.peer)]
        res = run.data[op.microbatch].results[op.stage]
        self._via(op.peer).send(tuple(res[n] for n in names), op.stage, op.peer, "act",
                                op.microbatch)

    def _op_send_out(self, run: StepRun, op: Op) -> None:
        self._via(op.peer).send(run.data[op.microbatch].cut, op.stage, op.peer, "out",
                                op.microbatch)

    def _op_recv_out(self, run: StepRun, op: Op) -> None:
        self._deliver_outputs(run, op.microbatch,
                              self._via(op.peer).recv(op.peer, op.stage, "out", op.microbatch))

    def _deliver_outputs(self, run: StepRun, mb: int, cut: Any, defer: bool = False) -> None:
        """The last stage's outputs, received on this rank: to microbatch ``mb``'s thread."""
        run.data[mb].cut = cut
        self.conductor.publish_outputs(mb, self.program.build_outputs(user_copy(cut)),
                                       hand=False, defer=defer)

    def _op_wait_b(self, run: StepRun, op: Op) -> None:
        run.data[op.microbatch].skip[op.stage] = (
            self.conductor.backward_of(op.microbatch) is None)

    def _op_recv_grad(self, run: StepRun, op: Op) -> None:
        d = run.data[op.microbatch]
        grads, cut = self._via(op.peer).recv(op.peer, op.stage, "grad", op.microbatch)
        if cut is not None and d.cut is None:  # the last stage's outputs, relayed
            # held back until this rank would wait, unless it will not wait again this step
            self._deliver_outputs(run, op.microbatch, cut, defer=run.at != run.lowered.last_recv)
        skipped = grads is None
        if d.skip.setdefault(op.stage, skipped) != skipped:
            raise _inconsistent(op, "the gradient messages from later stages disagree "
                                    f"(stage {op.peer}'s rank {'skipped' if skipped else 'ran'} "
                                    "it)")
        if skipped:
            return
        names = self._send_names[(op.stage, op.peer)]
        acc = d.grads.setdefault(op.stage, {})
        for name, g in zip(names, grads):
            acc.setdefault(name, []).append(g)

    def _op_b(self, run: StepRun, op: Op) -> None:
        mb, s = op.microbatch, op.stage
        d = run.data[mb]
        if not d.skip[s]:
            req, tensors, grads = self._backward_roots(run, mb, s)
            if tensors:
                with thread_modes(True, req.autocast):  # the seam (DDP) sees every pass
                    self.runners[s].backward(tensors, grads, mb)
        self._finish_backward(run, mb, s)
        self._backward_done(run, mb)

    def _op_i(self, run: StepRun, op: Op) -> None:
        """A split backward's input gradients (``split_backward``): sent on now, the
        weight gradients kept for this stage's ``W`` of the microbatch."""
        mb, s = op.microbatch, op.stage
        d = run.data[mb]
        got: list[torch.Tensor | None] = []
        if not d.skip[s]:
            req, tensors, grads = self._backward_roots(run, mb, s)
            inputs = self._inputleaves(d, s)
            if tensors:
                with thread_modes(True, req.autocast):
                    got, d.pending[s] = self.runners[s].backward_input(
                        tensors, grads, [t for t in inputs if isinstance(t, torch.Tensor)], mb)
        self._finish_backward(run, mb, s, iter(got))

    def _op_w(self, run: StepRun, op: Op) -> None:
        mb, s = op.microbatch, op.stage
        d = run.data[mb]
        pending = d.pending.pop(s, None)
        if pending is not None:
            req = self.conductor.backward_of(mb) or self.conductor.forward_of(mb, s)
            with thread_modes(True, req.autocast):
                self.runners[s].backward_weight(pending, mb)
        self._backward_done(run, mb)

    def _backward_roots(self, run: StepRun, mb: int, s: int
                        ) -> tuple[Request, list[torch.Tensor], list[torch.Tensor]]:
        """Where stage ``s``'s backward of microbatch ``mb`` starts: the user's loss tensors
        (scaled) on the last stage, else its outputs and the gradients received for them."""
        d = run.data[mb]
        # Off the last stage the step function may not have asked yet (see the module doc).
        req = self.conductor.backward_of(mb) or self.conductor.forward_of(mb, s)
        if s == self.last:
            return req, *self._loss_roots(run, mb, req)
        results = d.results.get(s, {})
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for name, glist in d.grads.get(s, {}).items():
            for i, t in enumerate(leaves(results[name])):
                gs = [g[i] for g in glist if g[i] is not None]
                if gs and isinstance(t, torch.Tensor) and t.requires_grad:
                    tensors.append(t)
                    grads.append(gs[0] if len(gs) == 1 else torch.stack(gs).sum(0))
        return req, tensors, grads

    def _inputleaves(self, d: MbData, s: int) -> list[Any]:
        """The leaves of every value stage ``s`` received, in ``recvs`` order."""
        inputs = d.inputs.get(s, {})
        return [t for _, names in self.program.stages[s].recvs for n in names
                for t in leaves(inputs[n])]

    def _finish_backward(self, run: StepRun, mb: int, s: int,
                         input_grads: Iterator[torch.Tensor | None] | None = None) -> None:
        """Keep the grads to send (the inputs' ``.grad`` after a B, ``input_grads`` in input
        order after an I), free the stage's saved state."""
        d = run.data[mb]
        inputs = d.inputs.pop(s, {})
        if not d.skip[s]:
            def grad_of(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return None
                if input_grads is None:
                    return t.grad
                return next(input_grads, None)

            d.send_grads[s] = {n: [grad_of(t) for t in leaves(inputs[n])]
                               for _, names in self.program.stages[s].recvs for n in names}
        d.results.pop(s, None)
        d.grads.pop(s, None)

    def _backward_done(self, run: StepRun, mb: int) -> None:
        """One local stage finished microbatch ``mb``'s backward (its B, or its W); after
        the last, release the user thread."""
        d = run.data[mb]
        d.b_done += 1
        if d.b_done == len(self.runners):
            self.conductor.publish_backward_done(mb)

    def _op_send_grad(self, run: StepRun, op: Op) -> None:
        d = run.data[op.microbatch]
        grads = None  # skipped: the receiver still expects the message (and the outputs)
        if not d.skip[op.stage]:
            names = self._recv_names[(op.stage, op.peer)]
            grads = tuple(d.send_grads[op.stage][n] for n in names)
        self._via(op.peer).send((grads, d.cut if self.multi_process else None), op.stage,
                                op.peer, "grad", op.microbatch)

    def _check_step(self, run: StepRun, asked: list[bool]) -> SMPRuntimeError | None:
        """A stage whose backward followed the gradient messages: its step function must
        have decided alike (``asked``: per microbatch, whether it called model.backward)."""
        for mb, d in enumerate(run.data):
            for s, skipped in d.skip.items():
                if skipped == asked[mb]:
                    did = "did" if skipped else "did not"
                    return _inconsistent(
                        Op("B", s, mb), f"this rank's step function {did} call it, yet the "
                        f"gradient messages say the backward was "
                        f"{'skipped' if skipped else 'run'}")
        return None

    def _loss_roots(self, run: StepRun, mb: int, req: Request
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``model.backward(tensors, grad_tensors)`` of microbatch ``mb``: the tensors and
        their gradients, scaled by the step's loss scale."""
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
                scaled.append(torch.full_like(t, run.scale))
            else:
                scaled.append(g * run.scale if run.scale != 1.0 else g)
        return ts, scaled


def _inconsistent(op: Op, what: str) -> SMPRuntimeError:
    return SMPRuntimeError.build(
        "every pipeline rank must call model.backward for the same microbatches", what,
        f"stage {op.stage} microbatch {op.microbatch}",
        "take the decision to call model.backward the same way on every rank (it may "
        "depend on the model outputs, which every rank sees)")
