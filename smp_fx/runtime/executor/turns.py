"""The records the conductor grants turns on, and a moment of the step read as words.

The words are written from a ``StepView`` taken under the conductor's lock, so they can
change without touching the turn-taking.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from smp_fx.runtime.executor.lowering import Op
from smp_fx.runtime.executor.modes import Autocast

if TYPE_CHECKING:  # straight.py imports ``Microbatch`` from here
    from smp_fx.runtime.executor.straight import ArgMap, Pieces

Microbatch = tuple[tuple[Any, ...], dict[str, Any]]  # a step function's (args, kwargs)


@dataclass
class Request:
    """What a step function asked for (``model(...)`` or ``model.backward(...)``), with
    its thread's grad mode and autocast, which apply to the work done for it."""

    args: Any
    grad_enabled: bool
    autocast: Autocast


@dataclass
class Turn:
    """One microbatch's side of the turn-taking during a step."""

    f_request: Request | None = None
    b_request: Request | None = None
    outputs: Any = None
    outputs_ready: bool = False
    backward_done: bool = False
    arg_map: ArgMap | None = None  # a threaded step's call, learned (``straight.ArgMap``)
    built: Request | None = None  # a straight step's forward request, built from its map


@dataclass(frozen=True)
class StepView:
    """The conductor's step at one moment; ``runnable`` is the conductor's own rule, so the
    words never disagree with it."""

    ops: tuple[Op, ...]
    next: int
    performing: bool
    turns: Sequence[Turn]
    started: Sequence[bool]
    done: Sequence[bool]
    runnable: Callable[[Op], bool]


Launch = tuple[Callable[..., Any], Sequence[Microbatch], bool, Autocast]
"""A step's (step function, microbatches, grad mode, autocast) its threads start from."""


@dataclass(eq=False, slots=True)
class StepTurns:
    """One step's turn-taking state, made by ``Conductor.run`` for each step and used under
    the conductor's lock."""

    ops: tuple[Op, ...]
    turns: list[Turn]
    conds: list[threading.Condition]
    main: threading.Condition
    launch: Launch
    main_thread: threading.Thread
    next_forward: Sequence[int] | None
    done: list[bool]
    started: list[bool]
    next: int = 0
    driving: bool = False
    handed_to: int = -1
    holder: int | None = None
    running: int = 0
    main_waiting: int = 0
    futures: dict[int, Future[Any]] = field(default_factory=dict)
    deferred: list[tuple[int, Any]] = field(default_factory=list)
    abort: BaseException | None = None
    abort_status: list[str] = field(default_factory=list)
    straight: Request | None = None  # straight-through (``straight.py``): what F ops take
    arg_map: ArgMap | None = None  # straight: where the F ops' model arguments come from
    learn_args: bool = False  # threaded: learn each call's ``ArgMap``
    pieces: list[Pieces] = field(default_factory=list)  # the microbatches' leaves, versions
    ready: list[int] = field(default_factory=list)  # straight: outputs there, not started
    results: list[Any] = field(default_factory=list)  # straight: the step functions' results

    def runnable(self, op: Op) -> bool:
        """Whether ``op`` can run now: a forward once its step function asked (or returned),
        a wait for the backward decision once it was taken; anything else at once."""
        if op.kind == "F":
            return self.turns[op.microbatch].f_request is not None or self.done[op.microbatch]
        if op.kind == "WAIT_B":
            return self.turns[op.microbatch].b_request is not None or self.done[op.microbatch]
        return True

    def view(self) -> StepView:
        """The step now, for the words below."""
        return StepView(self.ops, self.next, self.driving, self.turns, self.started,
                        self.done, self.runnable)

    def give_outputs(self, mb: int, outputs: Any) -> None:
        t = self.turns[mb]
        t.outputs, t.outputs_ready = outputs, True
        self.conds[mb].notify_all()

    def flush(self) -> None:
        """Hand out the deferred outputs."""
        for mb, outputs in self.deferred:
            self.give_outputs(mb, outputs)
        self.deferred.clear()

    def wake_all(self) -> None:
        for c in self.conds:
            c.notify_all()
        self.main.notify_all()

    def wake_main(self) -> None:
        """Wake a thread waiting on ``main``, if any (this runs after every driver's turn;
        a notify costs three Python calls even with nobody waiting)."""
        if self.main_waiting:
            self.main.notify_all()


def step_function_state(view: StepView, mb: int) -> str:
    """Where microbatch ``mb``'s step function is, in words."""
    t = view.turns[mb]
    if view.done[mb]:
        return "returned"
    if not view.started[mb]:
        return "not started"
    if t.f_request is None:
        return "running user code before model(...)"
    if not t.outputs_ready:
        return "waiting in model(...) for its outputs"
    if t.b_request is None:
        return "running user code after model(...)"
    return "backward done" if t.backward_done else "waiting for its backward turn"


def next_op_words(view: StepView, describe: Callable[[Op], str]) -> str:
    """The next op and what keeps it from running, in words."""
    ops, i = view.ops, view.next
    if i >= len(ops):
        return "every op of the step is done"
    op = ops[i]
    words = f"next op {op}: {describe(op)}"
    if view.performing:
        return words + ", being performed"
    if op.kind == "F" and view.turns[op.microbatch].f_request is None \
            and not view.done[op.microbatch]:
        return words + f", waiting for microbatch {op.microbatch}'s step function to " \
            "call model(...)"
    if op.kind == "WAIT_B" and not view.runnable(op):
        return words + f", waiting for microbatch {op.microbatch}'s step function"
    busy = [k for k in range(len(view.turns))
            if step_function_state(view, k).startswith("running")]
    return words + ", runnable, but every thread that could perform it runs user code" + (
        f" (step functions of microbatches {busy})" if busy else "")


def status_lines(view: StepView, describe: Callable[[Op], str]) -> list[str]:
    """The flight record's lines: the next op, then each microbatch's step function."""
    states = "; ".join(f"mb{k} {step_function_state(view, k)}"
                       for k in range(len(view.turns)))
    return [next_op_words(view, describe), f"step functions: {states}"]
