"""Sharded data parallelism (``sharded_data_parallel_degree``) on FSDP2 ``fully_shard``.

Each local stage is sharded over groups of its rdp group (HSDP when the degree is below
it; with tp, each tp rank's shards are sharded further). SMP's ``sdp_*`` parameters map
onto FSDP2 units, ignored parameters and a live-parameter bound; reductions sum and divide
explicitly because gloo's averaging ops are not to be trusted (pytorch #162338).
See docs/precision.md, 'Sharded data parallelism'.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx
from torch import nn

from cost_model.errors import SMPConfigError
from smp_fx.parallel import ep_sdp
from smp_fx.parallel.ddp import DataParallelOptions, allreduce_grads, buckets
from smp_fx.parallel.meshes import hybrid_mesh
from smp_fx.parallel.zero import AXIS, broadcast_flat
from smp_fx.runtime.executor.lowering import Op, trains
from smp_fx.runtime.executor.seams import StageRunner, StepHooks
from smp_fx.world import state

log = logging.getLogger("smp_fx.parallel.sdp")


@dataclass(frozen=True)
class ShardPlan:
    """How one stage is sharded: units of leaf modules, the root unit, the replicated."""

    units: tuple[tuple[str, ...], ...]
    unit_numels: tuple[int, ...]
    root_numel: int
    persistent: tuple[str, ...]

    @property
    def live_numel(self) -> int:
        """Most sharded elements gathered at once: the root and two neighbouring units."""
        pair = max((a + b for a, b in zip(self.unit_numels, self.unit_numels[1:])),
                   default=max(self.unit_numels, default=0))
        return self.root_numel + pair


def plan_units(gm: torch.fx.GraphModule, bucket: int, threshold: int,
               one_unit: bool = False) -> ShardPlan:
    """Group ``gm``'s called leaf modules into units of at most ``bucket`` sharded elements
    (parameters below ``threshold`` persist whole); ``one_unit``: none, every sharded
    parameter in the root unit (a compiled stage: ``one_unit_refusal``).

    >>> import torch.fx
    >>> seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    >>> p = plan_units(torch.fx.symbolic_trace(seq), bucket=40, threshold=5)
    >>> p.units, p.unit_numels, p.persistent
    ((('0', '1'),), (32,), ('0.bias', '1.bias'))
    """
    names = {id(p): n for n, p in gm.named_parameters()}
    persistent = tuple(n for n, p in gm.named_parameters() if p.numel() < threshold)
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    holders: dict[int, int] = {}
    for _, mod in gm.named_modules():
        for p in mod.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    fetched = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    units: list[tuple[str, ...]] = []
    numels: list[int] = []
    current: list[str] = []
    size = 0
    taken = 0
    for target, count in calls.items() if not one_unit else ():
        mod = gm.get_submodule(target)
        params = [p for p in mod.parameters() if p.numel() >= threshold]
        if count > 1 or not params or any(
                holders[id(p)] > 1 or names.get(id(p)) in fetched for p in params):
            continue
        n = sum(p.numel() for p in params)
        if current and size + n > bucket:
            units.append(tuple(current))
            numels.append(size)
            current, size = [], 0
        current.append(target)
        size += n
        taken += n
    if current:
        units.append(tuple(current))
        numels.append(size)
    sharded = sum(p.numel() for p in gm.parameters() if p.numel() >= threshold)
    return ShardPlan(tuple(units), tuple(numels), sharded - taken, persistent)


def one_unit_refusal(gm: torch.fx.GraphModule, st: state.State) -> str | None:
    """Why ``gm`` cannot be sharded as one unit (its graph compiled whole, FSDP2's hooks on
    the stage outside it: ``compile``), or None. One unit gathers every sharded parameter
    of the stage at once, which ``sdp_max_live_parameters`` bounds."""
    cfg = st.config
    live = plan_units(gm, cfg.sdp_reduce_bucket_size, cfg.sdp_param_persistence_threshold,
                      one_unit=True).live_numel
    if live <= cfg.sdp_max_live_parameters:
        return None
    return (f"sharded data parallelism: compiled, the stage is one FSDP2 unit, which gathers "
            f"its {live} sharded parameter elements at once, over sdp_max_live_parameters "
            f"({cfg.sdp_max_live_parameters}); raise it (or use more pipeline stages) to "
            "compile the stage")


def _mesh(st: state.State) -> Any:
    """This rank's FSDP2 mesh over its rdp group."""
    return hybrid_mesh(st.topology.groups(AXIS), st.config.sharded_data_parallel_degree,
                       st.rank, st.group(AXIS), st.device.type, "")


def _check_nodes(st: state.State) -> None:
    """An explicit hierarchical all-gather across several nodes cannot be honoured."""
    cfg = st.config
    if "sdp_hierarchical_allgather" not in cfg.explicit or not cfg.sdp_hierarchical_allgather:
        return
    nodes = {r // max(st.local_size, 1) for r in st.group_ranks(AXIS)}
    if len(nodes) > 1:
        raise SMPConfigError.build(
            "sdp_hierarchical_allgather: FSDP2 has no two-level all-gather across nodes",
            True, "sdp_hierarchical_allgather",
            "remove it (the backend's all-gather is used; numerics are the same)")


class ShardedDataParallel:
    """The sharded stages of one partitioned ``DistributedModel`` on this rank."""

    name: ClassVar[str] = "data_parallel"

    def __init__(self, options: DataParallelOptions, runners: Mapping[int, StageRunner],
                 st: state.State, whole: Sequence[nn.Parameter] = (),
                 experts: Any = None, one_unit: frozenset[int] = frozenset()) -> None:
        from torch.distributed.fsdp import fully_shard

        cfg = st.config
        self.group = st.group(AXIS)
        self.size = len(st.group_ranks(AXIS))
        self.src = st.group_ranks(AXIS)[0]
        self.broadcast_buffers = options.broadcast_buffers
        self.plans: dict[int, ShardPlan] = {}
        self.persistent: dict[int, list[nn.Parameter]] = {}
        self.buffers: list[torch.Tensor] = []
        self._training = False
        self.experts_sharded = experts is not None
        """Whether the expert slices (``whole``) are sharded on the mesh ``experts``."""
        mesh = _mesh(st)
        self.mesh = mesh  # the shard group is its last axis (smp_fx.parallel.ds_view)
        for s in sorted(runners):
            gm = runners[s].stage.module
            plan = plan_units(gm, cfg.sdp_reduce_bucket_size,
                              cfg.sdp_param_persistence_threshold, one_unit=s in one_unit)
            if plan.live_numel > cfg.sdp_max_live_parameters:
                raise SMPConfigError.build(
                    "the sharding plan gathers more parameters at once than "
                    "sdp_max_live_parameters allows (root unit + two neighbouring units)",
                    {"live": plan.live_numel, "limit": cfg.sdp_max_live_parameters},
                    f"stage {s}", "raise sdp_max_live_parameters or lower "
                    "sdp_reduce_bucket_size")
            named = dict(gm.named_parameters())
            apart = {id(p) for p in whole}  # another parallelism's (expert slices)
            keep = [named[n] for n in plan.persistent if id(named[n]) not in apart]
            ignored = set(keep) | {p for p in gm.parameters() if id(p) in apart}
            broadcast_flat([*(p for p in gm.parameters() if id(p) not in apart),
                            *gm.buffers()], self.src, self.group)
            for unit in plan.units:
                mods = [gm.get_submodule(t) for t in unit]
                sharded = fully_shard(mods, mesh=mesh, ignored_params=ignored)
                sharded[0].set_force_sum_reduction_for_comms(True)  # the unit's one state
            if experts is None:
                root = fully_shard(gm, mesh=mesh, ignored_params=ignored)
            else:  # the slices in the root unit, on their own mesh (smp_fx.parallel.ep_sdp)
                root = fully_shard(gm, mesh=mesh, ignored_params=set(keep),
                                   shard_placement_fn=ep_sdp.placement(apart, experts))
                root.set_gradient_divide_factor(float(self.size))  # experts' edp sum / rdp
            root.set_force_sum_reduction_for_comms(True)
            self.plans[s] = plan
            self.persistent[s] = keep
            self.buffers += list(gm.buffers())
        self.cap_mb = cfg.sdp_reduce_bucket_size * 4 / 2**20

    @property
    def reduce_this_step(self) -> bool:
        """Gradients are reduced at every training step (reduce-scattered by FSDP2)."""
        return self._training

    def hooks(self) -> StepHooks:
        """Before a step: buffers from rdp rank 0; after it: the replicated parameters'
        average (before the tied pipeline sum, ``smp_fx.parallel.build.POST_STEP_ORDER``)."""
        return StepHooks(self.pre_step, self.post_step)

    def pre_step(self, ops: Sequence[Op]) -> None:
        """Note whether the step trains; broadcast buffers from rdp rank 0 (DDP's default)."""
        self._training = trains(ops)
        if self.broadcast_buffers and self.buffers:
            broadcast_flat(self.buffers, self.src, self.group)

    def post_step(self) -> None:
        """Average the replicated (persistent) parameters' gradients over the rdp group."""
        if not self._training:
            return
        for s in sorted(self.persistent):
            if self.persistent[s]:
                allreduce_grads(buckets(self.persistent[s], self.cap_mb), self.group, self.size)


def enable(options: DataParallelOptions, runners: Mapping[int, StageRunner], st: state.State,
           whole: Sequence[nn.Parameter] = (), one_unit: frozenset[int] = frozenset()
           ) -> ShardedDataParallel:
    """Shard the local stages of ``runners`` (on every rank, at partitioning; collective
    over the rdp groups); ``whole``: expert slices, sharded over their edp group in the root
    unit (``smp_fx.parallel.ep_sdp``), or, where that shards nothing, left unsharded and
    unreduced for expert parallelism to reduce; ``one_unit``: the stages sharded as one unit
    (compiled whole, ``one_unit_refusal``)."""
    if options.backward_passes_per_step != 1:  # SMP defers the reduction; the sum is equal
        log.info("smp-fx sdp: backward_passes_per_step=%d: gradients are reduce-scattered at "
                 "every backward and accumulate in their shards until optimizer.step (the "
                 "same sum as reducing every %d steps)", options.backward_passes_per_step,
                 options.backward_passes_per_step)
    _check_nodes(st)
    experts = ep_sdp.expert_mesh(st) if whole and ep_sdp.shard_degree(st) > 1 else None
    sdp = ShardedDataParallel(options, runners, st, whole, experts, one_unit)
    log.info("smp-fx sdp: stages %s sharded over %d of %d rdp ranks; units %s",
             sorted(sdp.plans), st.config.sharded_data_parallel_degree, sdp.size,
             {s: len(p.units) for s, p in sdp.plans.items()})
    return sdp
