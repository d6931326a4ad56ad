"""The records the conductor grants turns on, and a moment of the step read as words.

One ``Turn`` per microbatch holds what its step function asked for (``model(...)``,
``model.backward(...)``), each ``Request`` with the grad mode and autocast of the thread that
made it, since they apply to the work done for it (``smp_fx.runtime.modes``). The words
(what keeps the next op from running, where every step function is) are what a timeout and
the flight record (``smp_fx.runtime.flight``) tell a person: they are written from a
``StepView`` the conductor takes with its lock held, so they can change for clarity without
touching the turn-taking (``smp_fx.runtime.conductor``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from smp_fx.runtime.lowering import Op
from smp_fx.runtime.modes import Autocast

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


@dataclass(frozen=True)
class StepView:
    """The conductor's step at one moment (the lists are its own: read under its lock).

    ``performing``: a thread is performing ``ops[next]`` now. ``runnable``: the conductor's
    own rule for whether an op can run (one rule, so the words never disagree with it).
    """

    ops: tuple[Op, ...]
    next: int
    performing: bool
    turns: Sequence[Turn]
    started: Sequence[bool]
    done: Sequence[bool]
    runnable: Callable[[Op], bool]


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
