"""The step log: each step's time per op kind and stage, read off the flight record.

Why: ``smp.write_measurement`` needs a run's figures (docs/planning.md, 'Learning from a
measured run'), and the flight record already stamps every op, so one pass over a step's
ops after it ends is all it costs. The log keeps the last ``KEEP`` steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from smp_fx.runtime.executor.flight import FlightRecorder
from smp_fx.runtime.executor.lowering import BACKWARD_OPS
from smp_fx.runtime.executor.modes import Autocast
from smp_fx.runtime.transport.values import leaves

KEEP = 1000


@dataclass(frozen=True)
class LoggedStep:
    began: float
    actions: dict[tuple[str, int], tuple[float, int]]
    """(kind, stage) -> (seconds, ops)."""
    receiving_s: float
    reducing_s: float


class StepLog:
    """Per executor: one ``LoggedStep`` per step (module docstring), plus what a plan needs
    to know of the steps' inputs (microbatch size, autocast dtype)."""

    def __init__(self) -> None:
        self.steps: deque[LoggedStep] = deque(maxlen=KEEP)
        self.mbs = 0
        self.autocast = ""

    def note_inputs(self, microbatches: Sequence[Any], autocast: Autocast) -> None:
        """The first step's microbatch size (its first tensor's leading dimension) and
        autocast dtype (a plan's precision)."""
        if self.mbs or not microbatches:
            return
        first = next((t for t in leaves(microbatches[0]) if isinstance(t, torch.Tensor)
                      and t.dim() > 0), None)
        self.mbs = int(first.shape[0]) if first is not None else 1
        self.autocast = str(autocast[0][1]).replace("torch.", "") if autocast else ""

    def step_done(self, flight: FlightRecorder, split: dict[str, float]) -> None:
        """Log the step just recorded in ``flight``; ``split``: its ``split_step``."""
        actions: dict[tuple[str, int], tuple[float, int]] = {}
        ops, starts = flight.ops, flight.starts
        for i, op in enumerate(ops):
            t, n = actions.get((op.kind, op.stage), (0.0, 0))
            actions[(op.kind, op.stage)] = (t + starts[i + 1] - starts[i], n + 1)
        self.steps.append(LoggedStep(flight.began, actions, split["receiving"],
                                     split["reducing"]))

    def figures(self, skip: int = 1) -> tuple[float, list[tuple[str, int, float, float]],
                                              float, float, int]:
        """(median step, actions as (kind, stage, median s per step, ops per step), median
        receiving, median reducing, steps counted): the first ``skip`` steps warm up; a
        step's time runs to the next one's start, so the last step only adds its actions."""
        steps = [s for s in list(self.steps)[skip:]
                 if any(k in BACKWARD_OPS for k, _ in s.actions)]  # training steps
        if len(steps) < 2:
            return 0.0, [], 0.0, 0.0, 0
        gaps = [b.began - a.began for a, b in zip(steps, steps[1:])]
        keys = sorted({k for s in steps for k in s.actions})
        actions = [(k, st, statistics.median(s.actions.get((k, st), (0.0, 0))[0]
                                             for s in steps),
                    statistics.median(s.actions.get((k, st), (0.0, 0))[1] for s in steps))
                   for k, st in keys]
        return (statistics.median(gaps), actions,
                statistics.median(s.receiving_s for s in steps),
                statistics.median(s.reducing_s for s in steps), len(gaps))
