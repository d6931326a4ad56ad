"""Mixed precision's step of the parallelisms' build: the loss scale and stale masters.

What the running model needs of the fp16 optimizer is the loss scale and, before each
step, word that its master gradients are stale; given when it binds. Last in the build's
order. See docs/precision.md, 'fp16'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from smp_fx.runtime.executor.lowering import Op
from smp_fx.runtime.executor.seams import StepHooks


class LossScaling(Protocol):
    """An fp16 optimizer as the running model sees it."""

    @property
    def loss_scale(self) -> float: ...

    def grads_may_change(self, ops: Sequence[Op]) -> None: ...


class MixedPrecision:
    """The fp16 optimizers bound to one partitioned model; the last one's loss scale
    applies (one optimizer per model is the usual case)."""

    name: ClassVar[str] = "mixed_precision"

    def __init__(self) -> None:
        self._scaling: list[LossScaling] = []

    def scale_with(self, optimizer: LossScaling) -> None:
        """``optimizer`` scales every later backward's loss and keeps fp32 masters."""
        self._scaling.append(optimizer)

    @property
    def loss_scale(self) -> float:
        """What ``model.backward`` multiplies the loss by (1 before an optimizer binds)."""
        return self._scaling[-1].loss_scale if self._scaling else 1.0

    def pre_step(self, ops: Sequence[Op]) -> None:
        for optimizer in self._scaling:
            optimizer.grads_may_change(ops)

    def hooks(self) -> StepHooks:
        """Before a step: a training step makes the masters' gradients stale."""
        return StepHooks(self.pre_step)
