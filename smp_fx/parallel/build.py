"""One build composes the parallelisms on a planned model, in one order, written down here.

``DistributedModel`` plans at its first step (``smp_fx.runtime.planning.planning``);
``parallelize``
turns that plan into this rank's running model. It splits and places the stages
(``smp_fx.runtime.planning.placement``), then applies the parallelisms in ``ORDER``, as
torchtitan's
``parallelize`` applies tensor parallelism, then activation checkpointing, then data
parallelism:

1. ``tied``: tied parameters replicated on several pipeline ranks (``parallel.tied``);
2. ``tensor_parallel``: the tp collectives bound to the group, the shards known
   (``parallel.tensor_parallel``; the graphs were rewritten while planning), then
   ``context_parallel``: the cp collectives bound, gradients summed over cp after a step
   (``parallel.context_parallel``);
3. ``activation_checkpointing``: checkpointed regions outlined, activations counted and
   offloaded (``runtime.memory.checkpointing``);
4. ``expert_parallel``: expert slices left out of data parallelism, their gradients
   reduced over the ranks holding the same experts (``parallel.expert_parallel``);
5. ``data_parallel``: DDP over each stage's rdp group, wrapping the stage runners
   (``parallel.ddp``), or sharded data parallelism (``parallel.sdp``); ZeRO-1
   optimizer-state sharding applies where an optimizer binds (``parallel.zero``);
6. ``mixed_precision``: the fp16 loss scale and master gradients (``parallel.precision``).

Each is a ``Parallelism``: what it does around a step is its ``hooks()``. What else it may
touch is what this function hands it: the stage runners (DDP wraps them, sharded data
parallelism shards their modules in place), the local parameters it owns, this rank's
groups. The executor is built last, with the final runners and the hooks in their order
(``PRE_STEP_ORDER``, ``POST_STEP_ORDER``): nothing is added to it later. An optimizer binds
through ``Parallelized.binding()`` (``DistributedOptimizer.bind``).

The hooks' order is part of the numerics. Before a step they run in build order. After it:
the data-parallel average first, then the tied pipeline sum (it sums only what this
reduction window added, which is equal on every dp replica once averaged, and it waits for
the step that reduces when ``backward_passes_per_step`` accumulates), then the tensor-
parallel sums and averages over tp, then the context-parallel sum over cp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.fx
from torch import nn

from cost_model.errors import SMPInternalError
from passes.plan import PartitionPlan
from passes.split_stages import StagedProgram
from passes.tensor_parallel import TensorParallelPlan
from smp_fx.parallel import ddp, ep_zero, sdp
from smp_fx.parallel.context_parallel import ContextParallelRuntime
from smp_fx.parallel.ddp import DataParallel, DataParallelOptions
from smp_fx.parallel.expert_parallel import ExpertParallel
from smp_fx.parallel.precision import MixedPrecision
from smp_fx.parallel.sdp import ShardedDataParallel
from smp_fx.parallel.tensor_parallel import TensorParallelRuntime
from smp_fx.parallel.tied import TiedReplicas, tied_duplicates, tied_groups
from smp_fx.parallel.zero import OptimizerShards, ZeroGroup, zero_group
from smp_fx.runtime.executor.compiled import CompileStats, compile_stages, one_unit_stages
from smp_fx.runtime.executor.executor import Executor
from smp_fx.runtime.executor.seams import PostStep, PreStep, StageRunner, StepHooks
from smp_fx.runtime.executor.stragglers import ROW, StragglerWatch
from smp_fx.runtime.inputs.shapes import ShapeGuard
from smp_fx.runtime.memory.checkpointing import ActivationCheckpointing
from smp_fx.runtime.planning.placement import (
    local_named_parameters,
    multi_process,
    place_stages,
    split_for_rank,
)
from smp_fx.world import comm, state

ORDER = ("tied", "tensor_parallel", "context_parallel", "activation_checkpointing",
         "expert_parallel", "data_parallel", "mixed_precision")
"""The order the build applies the parallelisms in (each applies only where configured)."""
PRE_STEP_ORDER = ORDER
"""Hooks before a step run in build order."""
POST_STEP_ORDER = ("data_parallel", "expert_parallel", "tied", "tensor_parallel",
                   "context_parallel")
"""Hooks after a step: the dp average before the tied pipeline sum (module docstring)."""


class Parallelism(Protocol):
    """One parallelism as the build applies it. ``name`` is its place in ``ORDER``;
    ``hooks()`` is all it does on the executor: before each step (with the step's ops) and
    after it (its gradient reduction)."""

    @property
    def name(self) -> str: ...

    def hooks(self) -> StepHooks: ...


@dataclass(frozen=True)
class OptimizerBinding:
    """What a partitioned model hands each of its optimizers (``DistributedOptimizer.bind``).

    ``local_parameters``: this rank's parameters by their plain names;
    ``canonical_names``: every alias of a parameter -> its first name (tied weights);
    ``is_distributed``: whether a parameter is a tensor-parallel shard; ``precision``: the
    fp16 step the optimizer's loss scale goes to (None without fp16); ``zero``: the group
    ZeRO-1 divides the optimizer's state over (None without ``shard_optimizer_state``).
    """

    local_parameters: tuple[tuple[str, nn.Parameter], ...]
    canonical_names: Mapping[str, str]
    is_distributed: Callable[[torch.Tensor], bool]
    precision: MixedPrecision | None
    zero: ZeroGroup | None
    experts: frozenset[int] = frozenset()
    """ids of the expert slices (``expert_parallel_degree`` > 1)."""

    def state_shards(self, params: list[torch.Tensor]) -> OptimizerShards | None:
        """ZeRO-1: ``params`` divided among the rdp ranks, expert slices among their edp
        ranks (``shard_optimizer_state``), or None (``smp_fx.parallel.ep_zero``)."""
        return ep_zero.shard_state(params, self.zero, self.experts)


@dataclass(frozen=True)
class Parallelized:
    """This rank's running model: its stages, runners and executor, and every parallelism
    the build applied (``applied``, in order; the typed fields name the same objects)."""

    program: StagedProgram
    runners: Mapping[int, StageRunner]
    executor: Executor
    shapes: ShapeGuard
    canonical_names: Mapping[str, str]
    applied: tuple[Parallelism, ...]
    tied: TiedReplicas | None = None
    tensor_parallel: TensorParallelRuntime | None = None
    data_parallel: DataParallel | None = None
    sharded: ShardedDataParallel | None = None
    precision: MixedPrecision | None = None
    compiled: Mapping[int, CompileStats] = field(default_factory=dict)
    """Per local stage, its compilation (``compile``; empty when off)."""
    zero: ZeroGroup | None = None
    """The group optimizers bound to this model divide their state over (ZeRO-1)."""

    @property
    def multi(self) -> bool:
        """The stages run in several processes (one each); else all in this one."""
        return self.executor.multi_process

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return local_named_parameters(self.runners, self.canonical_names)

    def is_distributed(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a tensor-parallel shard."""
        return self.tensor_parallel is not None and self.tensor_parallel.is_distributed(param)

    def distribution_axis(self, param: torch.Tensor) -> int | None:
        """The dimension a tensor-parallel shard is split along; None for a whole one."""
        return (self.tensor_parallel.distribution_axis(param)
                if self.tensor_parallel is not None else None)

    @property
    def tied_duplicates(self) -> frozenset[str]:
        """Local names of tied parameters a lower pipeline stage also holds (none
        in-process, where the stages share one object)."""
        return self.tied.duplicates if self.tied is not None else frozenset()

    def binding(self) -> OptimizerBinding:
        experts = frozenset(id(p) for a in self.applied if isinstance(a, ExpertParallel)
                            for p in a.params)
        return OptimizerBinding(tuple(self.local_named_parameters()), self.canonical_names,
                                self.is_distributed, self.precision, self.zero, experts)


def parallelize(gm: torch.fx.GraphModule, plan: PartitionPlan,
                tp_plan: TensorParallelPlan | None, canonical: Mapping[str, str],
                options: DataParallelOptions, st: state.State,
                early_dp: DataParallel | None = None,
                initialize: bool = True, experts: frozenset[str] = frozenset()
                ) -> Parallelized:
    """Place the planned ``gm`` on this rank and apply the parallelisms in ``ORDER``.

    Identical on every rank (the collectives it runs come in one order). ``canonical``:
    every alias of a parameter -> its first name, from the module before any
    materialisation replaced parameter objects. ``early_dp``: the ``DataParallel`` that
    ``DistributedModel.join()`` made before the first step, to apply. ``initialize=False``:
    delayed-init stages are allocated for weights loaded next, not initialised.
    ``experts``: FQNs of expert slices (``smp_fx.parallel.expert_parallel``). ``st``: what
    ``smp.init`` established, the one place degrees, groups and device are read from."""
    cfg = st.config
    program = split_for_rank(gm, st, len(plan.rank_of))
    multi = multi_process(st)
    # tied parameters are found by their names, on every rank, before materialising
    groups = tied_groups(program, st, dict(canonical), plan.rank_of) if multi else []
    placed = place_stages(gm, program, st, plan.rank_of, initialize)
    runners: dict[int, StageRunner] = dict(placed.runners)
    dp = None if cfg.sharded_data_parallel_degree > 1 else ddp.for_build(options, early_dp, st)
    applied: list[Parallelism] = []

    tied = None
    if groups:
        duplicates = tied_duplicates(program, st.axis_rank("pp"), dict(canonical),
                                     plan.rank_of)
        tied = TiedReplicas(groups, duplicates, runners, canonical, window=dp)
        if placed.delayed:  # replicas initialised on different ranks: take the first's
            tied.broadcast()
        applied.append(tied)

    tp = None
    if tp_plan is not None:
        tp = TensorParallelRuntime.bind(tp_plan, local_named_parameters(runners, canonical),
                                        st)
        applied.append(tp)

    cp = None
    if st.axis_size("cp") > 1:
        cp = ContextParallelRuntime.bind(local_named_parameters(runners, canonical), st)
        applied.append(cp)

    checkpointing = ActivationCheckpointing(plan, runners, cfg.offload_activations)
    applied.append(checkpointing)
    one_unit = (functools.partial(sdp.one_unit_refusal, st=st)
                if cfg.sharded_data_parallel_degree > 1 else None)
    compiled = (compile_stages(runners, cfg.compile, plan.config.pipeline, sharded=one_unit)
                if cfg.compile != "none" else {})

    sharded = None
    ep = ExpertParallel(experts, runners, options.bucket_cap_mb, st) if experts else None
    if ep is not None:
        applied.append(ep)
    if cfg.sharded_data_parallel_degree > 1:
        sharded = sdp.enable(options, runners, st, ep.params if ep is not None else (),
                             one_unit_stages(compiled))
        applied.append(sharded)
        if ep is not None and sharded.experts_sharded:
            ep.handed_over(runners)
        elif ep is not None:
            ep.follow(sharded)
        if tp is not None:  # FSDP2 replaced the shards with DTensor parameters
            tp.holding(local_named_parameters(runners, canonical))
        if cp is not None:
            cp.holding(p for _, p in local_named_parameters(runners, canonical))
    elif dp is not None:
        if ep is not None:  # before the wrap: data parallelism leaves the slices alone
            dp.ignore(ep.params)
            ep.follow(dp)
        runners = dp.wrap(runners)
        applied.append(dp)

    precision = None
    if cfg.fp16 or cfg.bf16:  # bf16: fp32 masters too, a loss scale of 1
        precision = MixedPrecision()
        applied.append(precision)

    pre, post = step_hooks(applied)
    check = placed.shapes.check_received if multi and placed.shapes.active else None
    executor = Executor(program, runners, placed.transport, placed.options,
                        keepers=checkpointing.keepers, check_received=check,
                        pre_step_hooks=pre, post_step_hooks=post,
                        stragglers=straggler_watch(st, dp))
    return Parallelized(program, runners, executor, placed.shapes, canonical, tuple(applied),
                        tied, tp, dp, sharded, precision, compiled, zero_group(st))


def straggler_watch(st: state.State, dp: DataParallel | None) -> StragglerWatch:
    """This rank's straggler watch: compared with its data-parallel group, exchanging over
    the world (``smp_fx.runtime.executor.stragglers``); stopped once ``join()`` was entered, after
    which the ranks' step counts may differ."""
    alone = st.in_process or st.world_size == 1
    gather = None if alone else (lambda value: comm.allgather(value, comm.WORLD))
    launch = None if alone else comm.row_gather(comm.WORLD, len(ROW))
    return StragglerWatch(st.rank, [st.rank] if alone else st.group_ranks("dp"), gather,
                          launch, paused=dp.ever_joined if dp is not None else lambda: False)


def step_hooks(applied: list[Parallelism]
               ) -> tuple[tuple[PreStep, ...], tuple[PostStep, ...]]:
    """The executor's hooks of the ``applied`` parallelisms, in ``PRE_STEP_ORDER`` and
    ``POST_STEP_ORDER``."""
    by_name = {p.name: p.hooks() for p in applied}
    pre = tuple(h.pre for n in PRE_STEP_ORDER if (h := by_name.get(n)) and h.pre)
    post = tuple(h.post for n in POST_STEP_ORDER if (h := by_name.get(n)) and h.post)
    unplaced = sorted(n for n, h in by_name.items()
                      if (h.post and n not in POST_STEP_ORDER) or n not in PRE_STEP_ORDER)
    if unplaced:
        raise SMPInternalError.build("a parallelism has no place in the build's hook order",
                                     unplaced, "smp_fx.parallel.build.step_hooks")
    return pre, post
