"""What the parallelisms plug into the executor: the stage runner and the step hooks, here
below both so a parallelism can name them without importing the executor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from passes.split_stages import Stage
from smp_fx.runtime.executor.deferred_gemms import DeferredStage
from smp_fx.runtime.executor.lowering import Op
from smp_fx.runtime.executor.split_backward import (
    Accumulators,
    PendingW,
    input_grads,
    weight_grads,
)


class StageRunner:
    """Runs one stage's module: the seam where data parallelism wraps ``module``; on the last
    stage the backward starts from the user's loss tensors."""

    def __init__(self, stage: Stage, device: torch.device) -> None:
        self.stage = stage
        self.module: torch.nn.Module = stage.module
        self.device = device
        self.accumulators = Accumulators()  # the split backward's, for this stage's I
        self.input_path_params: tuple[torch.Tensor, ...] = ()  # I computes their gradients
        self.deferred: DeferredStage | None = None  # compiled whole under a split backward

    def forward(self, inputs: Sequence[Any], microbatch: int) -> tuple[Any, ...]:
        out = tuple(self.module(*inputs))
        self.took(microbatch)
        return out

    def took(self, microbatch: int) -> None:
        """After a forward: a deferred stage files what its I will need."""
        if self.deferred is not None:
            self.deferred.take(microbatch)

    def backward(self, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                 microbatch: int) -> None:
        if self.deferred is not None:
            self.deferred.drop(microbatch)
        torch.autograd.backward(tensors, grads)

    def backward_input(self, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                       inputs: list[torch.Tensor], microbatch: int
                       ) -> tuple[list[torch.Tensor | None], PendingW]:
        """A split backward's I (``smp_fx.runtime.executor.split_backward``): the gradients of
        ``inputs`` only, and what the W of this microbatch needs."""
        if self.deferred is not None:
            return self.deferred.input_grads(tensors, grads, inputs, microbatch)
        return input_grads(tensors, grads, inputs, list(self.stage.module.parameters()),
                           self.accumulators, self.input_path_params)

    def backward_weight(self, pending: PendingW, microbatch: int) -> None:
        """A split backward's W: the stage's weight gradients, accumulated into ``.grad``."""
        weight_grads(pending)


PreStep = Callable[[tuple[Op, ...]], None]
"""A hook run before each step with the step's ops (data parallelism finds each stage's last
backward there)."""
PostStep = Callable[[], None]
"""A hook run after each step (gradient reductions)."""


@dataclass(frozen=True)
class StepHooks:
    """What one parallelism does around every step: ``pre`` before it, with its ops, and
    ``post`` after it (its gradient reduction); None where it does nothing then."""

    pre: PreStep | None = None
    post: PostStep | None = None
