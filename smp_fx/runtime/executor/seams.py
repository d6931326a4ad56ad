"""What the parallelisms plug into the executor: the stage runner and the step hooks.

The executor calls a local stage only through its ``StageRunner`` and runs, around every
step, the hooks it was built with (``StepHooks`` of each parallelism, in the order
``smp_fx.parallel.build`` composes them). Here, below both, so that a parallelism can name
them without importing the executor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from passes.split_stages import Stage
from smp_fx.runtime.executor.lowering import Op
from smp_fx.runtime.executor.split_backward import PendingW, input_grads, weight_grads


class StageRunner:
    """Runs one stage's module: the seam where data parallelism wraps ``module``.

    The DDP work replaces ``module`` with a ``DistributedDataParallel`` wrapper and uses
    ``no_sync`` for all microbatches but the last; the executor only calls ``forward`` and
    ``backward`` (or, for a split backward, ``backward_input`` then ``backward_weight``)
    here. On the last stage the backward gets the user's loss tensors (and scaled grads):
    that one autograd pass runs through the loss into the stage.
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

    def backward_input(self, tensors: list[torch.Tensor], grads: list[torch.Tensor],
                       inputs: list[torch.Tensor], microbatch: int
                       ) -> tuple[list[torch.Tensor | None], PendingW]:
        """A split backward's I (``smp_fx.runtime.executor.split_backward``): the gradients of
        ``inputs`` only, and what the W of this microbatch needs."""
        return input_grads(tensors, grads, inputs, list(self.stage.module.parameters()))

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
