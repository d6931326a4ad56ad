"""Tied parameters across pipeline stages: one ``Parameter`` read on several stages.

In one process the stages share the object and autograd sums its gradient; across
processes each owner holds a replica, started equal and kept equal by summing gradients
over the owners after every step, after the data-parallel average.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn

from passes.split_stages import StagedProgram
from smp_fx.runtime.executor.lowering import Op
from smp_fx.runtime.executor.seams import StageRunner, StepHooks
from smp_fx.runtime.planning.placement import local_named_parameters
from smp_fx.world import state


class ReductionWindow(Protocol):
    """Data parallelism as the tied sum sees it: whether the step now ending reduces
    (``backward_passes_per_step`` accumulates over several steps, then reduces once)."""

    @property
    def reduce_this_step(self) -> bool: ...


class TiedReplicas:
    """The tied parameters this rank replicates, and the summing of their gradients.

    ``snapshot`` and ``reduce`` bracket one reduction window; under data-parallel
    accumulation the sum waits for the step that reduces over dp."""

    name: ClassVar[str] = "tied"

    def __init__(self, groups: list[tuple[Any, list[str]]], duplicates: frozenset[str],
                 runners: Mapping[int, StageRunner], canonical: Mapping[str, str],
                 window: ReductionWindow | None = None) -> None:
        self.groups = groups
        self.duplicates = duplicates
        self._runners = runners
        self._canonical = canonical
        self._window = window
        self._base: dict[str, torch.Tensor | None] | None = None

    def hooks(self) -> StepHooks:
        return StepHooks(self.pre_step, self.post_step)

    def _params(self) -> dict[str, nn.Parameter]:
        return dict(local_named_parameters(self._runners, self._canonical))

    def pre_step(self, ops: Sequence[Op]) -> None:
        self.snapshot(self._params())

    def post_step(self) -> None:
        if self._window is not None and not self._window.reduce_this_step:
            return  # ddp accumulating (backward_passes_per_step): sum once, when dp reduces
        self.reduce(self._params())

    def broadcast(self) -> None:
        """Give every replica of a tied parameter the lowest owning rank's values."""
        params = self._params()
        for group, names in self.groups:
            src = min(dist.get_process_group_ranks(group))
            with torch.no_grad():
                for n in names:
                    dist.broadcast(params[n].data, src=src, group=group)

    def snapshot(self, params: Mapping[str, nn.Parameter]) -> None:
        """At the start of a reduction window, remember the tied gradients (already summed)."""
        if self._base is not None:
            return  # ddp accumulating over several steps: the window began earlier
        grads = {n: params[n].grad for _, names in self.groups for n in names}
        self._base = {n: None if g is None else local_view(g).detach().clone()
                      for n, g in grads.items()}

    def reduce(self, params: Mapping[str, nn.Parameter]) -> None:
        """Sum over their owners only what this window added to replicated parameters' gradients,
        so gradients accumulated without ``zero_grad`` are never summed twice."""
        base = self._base or {}
        self._base = None
        for group, names in self.groups:
            ts = [params[n] for n in names]
            parts = []
            for n, p in zip(names, ts):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = local_view(p.grad)
                b = base.get(n)
                parts.append((g - b if b is not None else g).reshape(-1))
            flat = torch.cat(parts)
            dist.all_reduce(flat, group=group)
            offset = 0
            for n, p in zip(names, ts):
                assert p.grad is not None
                local = local_view(p.grad)
                g = flat[offset:offset + local.numel()].view_as(local)
                offset += local.numel()
                b = base.get(n)
                local.copy_(g + b if b is not None else g)


def tied_duplicates(program: StagedProgram, pp_rank: int, canonical: dict[str, str],
                    rank_of: Sequence[int] | None = None) -> frozenset[str]:
    """Names (canonical, as ``local_named_parameters`` gives them) of pipeline rank
    ``pp_rank``'s parameters whose tied twin a lower rank holds too (``rank_of``: the rank
    of each stage, chunks of one rank sharing their parameters; default one stage each)."""
    rank_of = list(rank_of) if rank_of is not None else list(range(len(program.stages)))

    def names(ranks: Any) -> set[str]:
        return {canonical.get(n, n) for s, st in enumerate(program.stages) if rank_of[s] in ranks
                for n, _ in st.module.named_parameters()}

    return frozenset(names({pp_rank}) & names(set(range(pp_rank))))


def tied_groups(program: StagedProgram, st: state.State, canonical: dict[str, str],
                rank_of: Sequence[int] | None = None) -> list[tuple[Any, list[str]]]:
    """Groups of the pp ranks owning each tied parameter, created collectively; tied-ness comes
    from the module's aliases, not identity (delayed stages hold re-created parameters)."""
    rank_of = list(rank_of) if rank_of is not None else list(range(len(program.stages)))
    owners: dict[str, list[int]] = {}
    for s, stage in enumerate(program.stages):
        for name, _ in stage.module.named_parameters():
            canon = canonical.get(name, name)
            owners.setdefault(canon, [])
            if rank_of[s] not in owners[canon]:
                owners[canon].append(rank_of[s])
    by_owner_set: dict[tuple[int, ...], list[str]] = {}
    for canon, ranks_of in sorted(owners.items()):
        if len(ranks_of) > 1:
            by_owner_set.setdefault(tuple(sorted(ranks_of)), []).append(canon)
    out: list[tuple[Any, list[str]]] = []
    for owner_ranks, canons in sorted(by_owner_set.items()):
        for pipeline in st.topology.groups("pp"):
            ranks = [pipeline[r] for r in sorted(owner_ranks)]
            group = dist.new_group(ranks)
            if st.rank in ranks:  # local_named_parameters() names them canonically too
                out.append((group, list(canons)))
    return out


def local_view(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a sharded (DTensor) gradient, else
    ``t``. Tied replicas on several stages are sharded alike over equal dp groups, so
    their shards line up."""
    return getattr(t, "_local_tensor", t)
