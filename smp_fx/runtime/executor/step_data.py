"""What the executor holds during one step: ``MbData`` per microbatch, ``StepRun`` for the
step (dropped at its end), ``StepStats`` for what the last step did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from smp_fx.runtime.executor.lowering import Lowered, Op
from smp_fx.runtime.executor.split_backward import PendingW


@dataclass
class MbData:
    """Everything one microbatch holds on this rank during a step (per stage: name -> value)."""

    skip: dict[int, bool] = field(default_factory=dict)  # stage -> its backward was skipped
    inputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    grads: dict[int, dict[str, list[Any]]] = field(default_factory=dict)  # from later stages
    send_grads: dict[int, dict[str, list[Any]]] = field(default_factory=dict)
    pending: dict[int, PendingW] = field(default_factory=dict)  # stage -> its W, after its I
    b_done: int = 0  # local stages whose backward finished (its B, or its W)
    cut: Any = None  # the last stage's outputs as handed to the user
    # straight steps: (stage, received shapes) to check at the model(...) call
    late_checks: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


@dataclass
class StepStats:
    """What the last step did: peak microbatches holding saved state, per local stage."""

    peak_in_flight: dict[int, int] = field(default_factory=dict)
    ops: tuple[Op, ...] = ()


@dataclass(eq=False, slots=True)
class StepRun:
    """What the executor holds during one step: its lowering, the loss scale, each
    microbatch's values, the ops after which offloaded activations come back, the
    statistics, and the position of the op being performed."""

    lowered: Lowered
    scale: float
    data: list[MbData]
    prefetch: dict[int, list[tuple[int, int]]]
    stats: StepStats
    at: int = 0


__all__ = ["MbData", "StepRun", "StepStats"]
