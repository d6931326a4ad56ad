"""Straight-through steps: a rank whose ops need nothing from its step function but the
backward decision runs them on the calling thread, and each step function there once its
outputs are (before the decision is read, on the last stage's rank).

``runs_straight`` chooses the mode per lowering; ``ModeMemo`` says which grad mode and
autocast the forwards take (learned from the step function's threaded first step);
``call_mismatch`` is the error when a step function then calls the model otherwise.
See docs/runtime.md ('Threads') and docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cost_model.errors import SMPRuntimeError
from smp_fx.runtime.executor.modes import Autocast

if TYPE_CHECKING:  # lowering calls ``runs_straight``
    from passes.split_stages import StagedProgram

Modes = tuple[bool, Autocast]  # (grad enabled, autocast) of a model(...) call


def runs_straight(program: StagedProgram, stages: Sequence[int], multi_process: bool) -> bool:
    """Whether this rank runs its ops without step-function threads: across processes,
    no stage takes ``model(...)``'s arguments. The last stage's rank runs each step
    function once its forward is done and before the op that reads its backward decision
    (``WAIT_B``). Buys, 1F1B p = 4 middle ranks per step (step_counts.py --ranks 4,
    smp-fx / torch): Python CPU outside compute 5.2-7.7 / 2.8-4.6 -> 4.2-5.1 / 2.5-3.2 ms,
    step-function threads' 0.7-1.2 -> 0 ms, voluntary switches 56-68 / 43-53 -> 34-40."""
    return multi_process and not any(program.stages[s].program_inputs for s in stages)


class ModeMemo:
    """Per step function and launch modes: the modes its ``model(...)`` calls took in its
    first (threaded) step, if every microbatch's agreed; a straight step's forwards take
    them, and a call that differs is an error (``call_mismatch``)."""

    LIMIT = 16  # step functions remembered (a script has a few)

    def __init__(self) -> None:
        self._seen: dict[tuple[Callable[..., Any], Modes], Modes | None] = {}

    def get(self, fn: Callable[..., Any], launch: Modes) -> Modes | None:
        """The modes to run straight with; None: run threaded (not learned, or disagreed)."""
        return self._seen.get((fn, launch))

    def known(self, fn: Callable[..., Any], launch: Modes) -> bool:
        return (fn, launch) in self._seen

    def learn(self, fn: Callable[..., Any], launch: Modes, calls: Sequence[Modes | None]
              ) -> None:
        """Remember the modes of a threaded step's calls (None: a microbatch made none)."""
        if len(self._seen) >= self.LIMIT:
            self._seen.pop(next(iter(self._seen)))
        agreed = calls and all(c is not None and c == calls[0] for c in calls)
        self._seen[(fn, launch)] = calls[0] if agreed else None


def call_mismatch(mb: int, rank: int, want: Modes, got: Modes) -> SMPRuntimeError:
    """A straight step's ``model(...)`` call under other modes than its forwards took."""
    return SMPRuntimeError.build(
        "a step function must call model(...) under the same torch.no_grad/autocast in "
        "every step (this rank runs its forwards before the step function, with the modes "
        "its first step used)", f"grad enabled {got[0]}, autocast {list(got[1])}; the "
        f"forwards ran with grad enabled {want[0]}, autocast {list(want[1])}",
        f"rank {rank} microbatch {mb}",
        "set torch.no_grad()/autocast the same way in every call of this step function, "
        "or around the smp.step call, or use another step function for the other mode")


def not_called(mb: int, rank: int) -> SMPRuntimeError:
    """A straight step's step function returned without calling the model."""
    return SMPRuntimeError.build(
        "the smp.step function returned without calling the DistributedModel",
        f"microbatch {mb}", f"rank {rank}", "call model(...) inside every smp.step function")


__all__ = ["ModeMemo", "Modes", "call_mismatch", "not_called", "runs_straight"]
