"""The runtime side of tensor parallelism: the group the rewritten graph's collectives use,
which local parameters are shards, and the gradient averaging ``prescaled_batch`` needs.

Under ``prescaled_batch: false`` tp ranks saw different examples, so replicated gradients
are averaged over the tp group too. See docs/tensor_parallel.md, 'Batches and gradients'.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch
from torch import nn

from passes import axis_groups
from passes.tensor_parallel import TensorParallelPlan
from passes.tensor_parallel import collectives as tp_collectives
from passes.tensor_parallel.coverage import coverage
from smp_fx.runtime.executor.lowering import Op, trains
from smp_fx.runtime.executor.seams import StepHooks
from smp_fx.world import state

log = logging.getLogger("smp_fx.parallel.tensor_parallel")


class TensorParallelRuntime:
    """This rank's tensor-parallel state for one partitioned ``DistributedModel``."""

    name: ClassVar[str] = "tensor_parallel"

    def __init__(self, plan: TensorParallelPlan, local: Iterable[tuple[str, nn.Parameter]],
                 average_replicated: bool) -> None:
        self.plan = plan
        self.average_replicated = average_replicated
        self._training = False
        self.holding(local)

    def holding(self, local: Iterable[tuple[str, nn.Parameter]]) -> None:
        """Know this rank's parameters by name: at binding, and again after sharded data
        parallelism replaced them with ``DTensor`` parameters of the same names."""
        params = list(local)
        specs = {s.name: s for s in self.plan.sharded}
        chunked = set(self.plan.sequence_parallel)
        self._distributed_ids = {id(p) for n, p in params if n in specs}
        self._axes = {id(p): specs[n].dim for n, p in params if n in specs}
        self.replicated = [p for n, p in params if n not in specs]
        self.chunked = [p for n, p in params if n in chunked]
        """Read by sequence-chunked ops: gradients summed over tp after each step."""

    @staticmethod
    def bind(plan: TensorParallelPlan, local: Iterable[tuple[str, nn.Parameter]],
             st: state.State) -> TensorParallelRuntime:
        """Bind the collectives to this rank's tp group (called at partitioning); ``local``:
        this rank's parameters by name (``DistributedModel.local_named_parameters``)."""
        axis_groups.bind("tp", st.group("tp"), st.axis_size("tp"), st.axis_rank("tp"))
        rt = TensorParallelRuntime(plan, local, not st.config.prescaled_batch)
        if st.rank == 0:  # one report for the model (every rank's plan is the same)
            report = coverage(plan)
            level = logging.WARNING if plan.replicated else logging.INFO
            log.log(level, "smp-fx %s", report.text())
        return rt

    def hooks(self) -> StepHooks:
        """Before a step: whether it trains; after it: the sums and averages over tp."""
        return StepHooks(self.pre_step, self.post_step)

    def is_distributed(self, param: torch.Tensor) -> bool:
        return id(param) in self._distributed_ids

    def distribution_axis(self, param: torch.Tensor) -> int | None:
        """The dimension ``param`` is split along over the tp ranks; None if it is whole."""
        return self._axes.get(id(param))

    def pre_step(self, ops: Sequence[Op]) -> None:
        self._training = trains(ops)

    def post_step(self) -> None:
        if self._training and self.chunked:
            tp_collectives.sum_grads(self.chunked)  # each rank's covers its sequence chunk
        if self._training and self.average_replicated:
            tp_collectives.average_grads(self.replicated)
