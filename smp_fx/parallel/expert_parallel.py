"""Expert parallelism in the build: the experts' gradients and their full state.

The experts were split before tracing (``smp_fx.parallel.ep_experts``); what remains is
the rule for their gradients. Every other parameter is averaged over the rdp group by data
parallelism. An expert slice has different values on the ranks of an ep group, so data
parallelism leaves it alone (``DataParallel.ignore``) and, after the step, this
parallelism sums its gradient over the edp group (the ranks holding the same experts) and
scales it by 1 / rdp: the slice's gradient already holds the tokens of every rank of its
ep group (the all-to-all's backward brought them), so the sum over edp covers every dp
rank once, and 1 / rdp makes it the average data parallelism takes of the rest. Under
sharded data parallelism FSDP2 shards the slices over the edp group and reduce-scatters
that same sum (``smp_fx.parallel.ep_sdp``; ``handed_over``).

Checkpoints gather the slices whole and cut them on load (``smp_fx.ckpt.ep_shards``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar, Protocol

import torch.distributed as dist
from torch import nn

from smp_fx.parallel.ddp import allreduce_grads, buckets
from smp_fx.runtime.executor.seams import StageRunner, StepHooks
from smp_fx.world import expert_groups, state

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""The parameters of ``ExpertParallelExperts``, split over the ep group."""


def expert_names(paths: Iterable[str]) -> frozenset[str]:
    """The FQNs of the expert slices of the blocks at ``paths``."""
    return frozenset(f"{p}.{n}" for p in paths for n in EXPERT_PARAMS)


class ReduceWindow(Protocol):
    """Data parallelism as the experts follow it: whether this step reduces gradients."""

    @property
    def reduce_this_step(self) -> bool: ...


class ExpertParallel:
    """This rank's expert slices and their gradient reduction over the edp group."""

    name: ClassVar[str] = "expert_parallel"

    def __init__(self, names: frozenset[str], runners: Mapping[int, StageRunner],
                 bucket_cap_mb: float, st: state.State) -> None:
        self.names = names
        self.params: list[nn.Parameter] = self._find(runners)
        self.window: ReduceWindow | None = None
        self.buckets = buckets(self.params, bucket_cap_mb)
        self.rdp_size = st.axis_size("rdp")
        self.group = expert_groups.get_edp_process_group()
        if not st.in_process and self.rdp_size > 1:  # replicas start as edp rank 0's
            for p in self.params:
                dist.broadcast(p.data, src=expert_groups.get_edp_group()[0], group=self.group)

    def _find(self, runners: Mapping[int, StageRunner]) -> list[nn.Parameter]:
        return [p for r in runners.values() for n, p in r.stage.module.named_parameters()
                if n in self.names]

    def handed_over(self, runners: Mapping[int, StageRunner]) -> None:
        """FSDP2 sharded the slices (new parameter objects) and reduces their gradients:
        nothing left to reduce here."""
        self.params = self._find(runners)
        self.buckets = []

    def follow(self, window: ReduceWindow) -> None:
        """Reduce on the steps ``window`` (the data parallelism of every other parameter,
        which leaves the slices out) reduces."""
        self.window = window

    def hooks(self) -> StepHooks:
        return StepHooks(None, self.post_step)

    def post_step(self) -> None:
        """Sum over edp, scaled 1 / rdp, on the steps data parallelism reduces."""
        if self.window is not None and self.window.reduce_this_step and self.buckets:
            allreduce_grads(self.buckets, self.group, self.rdp_size)

