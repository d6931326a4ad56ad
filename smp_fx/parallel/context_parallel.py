"""The runtime side of context parallelism: the group the rewritten graph's collectives use,
and the gradient sum over it.

Each cp rank computes its own tokens, so its parameter gradients cover only them; after
each training step they are summed over the cp group (the data-parallel average over rdp
is separate and commutes with it). Only what this step added is summed: gradients a
script accumulates over several steps were summed when their step ended.
``ContextParallelRuntime.bind`` is the context-parallel step of ``smp_fx.parallel.build``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch
from torch import nn

from passes import axis_groups
from passes.context_parallel import collectives as cp_collectives
from smp_fx.runtime.executor.lowering import Op, trains
from smp_fx.runtime.executor.seams import StepHooks
from smp_fx.world import state


class ContextParallelRuntime:
    """This rank's context-parallel state for one partitioned ``DistributedModel``."""

    name: ClassVar[str] = "context_parallel"

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = list(params)
        self._training = False
        self._before: dict[int, torch.Tensor] = {}

    def holding(self, params: Iterable[nn.Parameter]) -> None:
        """Sum these parameters' gradients: sharded data parallelism replaced the bound ones
        with ``DTensor`` parameters, whose gradients are this rank's reduce-scattered shard
        (summing the shards over cp equals reduce-scattering the cp sum: both are linear)."""
        self.params = list(params)

    @staticmethod
    def bind(local: Iterable[tuple[str, nn.Parameter]], st: state.State
             ) -> ContextParallelRuntime:
        """Bind the collectives to this rank's cp group; ``local``: this rank's parameters.
        The group is held there only, so ``smp_fx.world.state._reset`` can release it."""
        axis_groups.bind("cp", st.group("cp"), st.axis_size("cp"), st.axis_rank("cp"))
        return ContextParallelRuntime(p for _, p in local)

    def hooks(self) -> StepHooks:
        return StepHooks(self.pre_step, self.post_step)

    def pre_step(self, ops: Sequence[Op]) -> None:
        self._training = trains(ops)
        self._before = {id(p): _local(p.grad).detach().clone() for p in self.params
                        if self._training and p.grad is not None}

    def post_step(self) -> None:
        if not self._training:
            return
        grads = [(p, _local(p.grad)) for p in self.params if p.grad is not None]
        if not grads:
            return
        added = [g - self._before[id(p)] if id(p) in self._before else g for p, g in grads]
        flat = torch.cat([g.reshape(-1) for g in added])
        cp_collectives.sum_over_group(flat)
        offset = 0
        for p, g in grads:
            total = flat[offset:offset + g.numel()].view_as(g)
            before = self._before.get(id(p))
            g.copy_(total if before is None else before + total)
            offset += g.numel()
        self._before = {}


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``grad``: a ``DTensor``'s shard (in place), else itself."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad
