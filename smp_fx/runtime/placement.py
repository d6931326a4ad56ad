"""Placing a planned model on this rank: split it, pick the transport, build the runners.

``DistributedModel`` partitions in two halves: deciding (trace and plan,
``smp_fx.runtime.planning``) and placing (this module): the stages split from the planned
graph, the devices and transport (one process runs every stage, or each process its own),
each local stage's modules materialised on its device, the executor with its activation
keepers and checkpointed regions, the shape guard, and which tied parameters this rank
replicates. The result is a value the model adopts whole; what the model wires on top of
it (tied-gradient hooks, tensor and data parallelism, optimizers, post-partition hooks) reads
the model and stays there. Identical on every rank, as the plan is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from cost_model.errors import SMPConfigError
from passes.plan import PartitionPlan
from passes.split_stages import StagedProgram, split_stages
from smp_fx.delayed_init import allocate, is_delayed, materialize
from smp_fx.dist import launch, state
from smp_fx.dist.tied import TiedReplicas, has_tied, tied_duplicates, tied_groups
from smp_fx.runtime import executor as ex
from smp_fx.runtime.activations import ActivationKeeper
from smp_fx.runtime.checkpointing import outline_regions
from smp_fx.runtime.dist_transport import DistTransport
from smp_fx.runtime.planning import agree_on_plan, weights_device
from smp_fx.runtime.shapes import ShapeGuard, guard_for
from smp_fx.runtime.transport import InProcessTransport, Transport


@dataclass(frozen=True)
class Placement:
    """This rank's share of the partitioned model, ready to run.

    ``multi``: the stages run in several processes (one each); else all in this one.
    ``delayed``: a local stage was built under ``smp.delay_param_initialization`` (its tied
    replicas must then be made equal across ranks). ``tied_duplicates``: local names of tied
    parameters a lower stage also holds (none in-process, where stages share the object).
    """

    program: StagedProgram
    runners: dict[int, ex.StageRunner]
    executor: ex.Executor
    shapes: ShapeGuard
    multi: bool
    delayed: bool
    tied: TiedReplicas
    tied_duplicates: frozenset[str]


def place_stages(gm: torch.fx.GraphModule, plan: PartitionPlan,
                 canonical_names: dict[str, str], st: state.State,
                 initialize: bool = True) -> Placement:
    """Split the planned ``gm`` and place this rank's stages (see the module docstring).

    ``canonical_names`` maps every alias of a parameter to its first name (tied weights);
    it must come from the module before any materialisation replaced parameter objects.
    ``initialize=False``: delayed-init stages are allocated, not initialised (their weights
    are loaded next)."""
    cfg = st.config
    p = cfg.pipeline_parallel_degree
    multi = not st.in_process and st.axis_size("pp") > 1
    if not st.in_process and st.world_size > 1:
        agree_on_plan(gm, st)
    program = split_stages(gm, p)
    timeout_s = launch.timeout().total_seconds()
    transport: Transport
    if multi:
        pp_rank = st.axis_rank("pp")
        local = [pp_rank]
        devices = {pp_rank: st.device}
        transport = DistTransport(st.group_ranks("pp"), pp_rank, st.device, timeout_s,
                                  DistTransport.make_groups())
    else:
        local = list(range(p))
        devices = _in_process_devices(p, st.device, program)
        transport = InProcessTransport(devices)
    runners = {s: ex.StageRunner(program.stages[s], devices[s]) for s in local}
    delayed = any(is_delayed(r.module) for r in runners.values())
    # tied parameters are found by the original objects, before materialising
    tied = TiedReplicas(tied_groups(program, st, canonical_names) if multi else [])
    duplicates = tied_duplicates(program, pp_rank, canonical_names) if multi else frozenset()
    traced_on = weights_device(gm)  # where the plan traced
    for s, r in runners.items():
        _materialise(r.module, devices[s], initialize)
        _retarget_devices(r.stage.module, traced_on, devices[s])
    executor = ex.Executor(program, runners, transport, multi, timeout_s, st.rank,
                           st.group_ranks("pp") if multi else None)
    shapes = guard_for(gm, program)
    if multi and shapes.active:
        executor.check_received = shapes.check_received
    _checkpoint_stages(plan, executor, runners, cfg)
    return Placement(program, runners, executor, shapes, multi, delayed, tied, duplicates)


def _checkpoint_stages(plan: PartitionPlan, executor: ex.Executor,
                       runners: dict[int, ex.StageRunner], cfg: Any) -> None:
    """Each local stage runs its checkpointed regions under torch's checkpoint, and
    gets the saved-tensor hooks that offload their inputs (``offload_activations``)."""
    if cfg.offload_activations and not any(st.checkpointed for st in plan.stages):
        raise SMPConfigError.build(
            "'offload_activations' moves checkpointed regions' inputs, and no module "
            "is checkpointed", True, "smp.DistributedModel (first smp.step)",
            "call smp.set_activation_checkpointing(module) before the first step, or "
            "drop 'offload_activations'")
    executor.loading_horizon = cfg.activation_loading_horizon
    for s, r in runners.items():
        outline_regions(r.stage.module)
        state_tensors = [*r.stage.module.parameters(), *r.stage.module.buffers()]
        executor.keepers[s] = ActivationKeeper(state_tensors, offload=cfg.offload_activations)


def _in_process_devices(p: int, device: torch.device,
                        program: StagedProgram) -> dict[int, torch.device]:
    """cuda:0..p-1 when there are that many GPUs and no tied parameters, else one device."""
    if device.type == "cuda" and torch.cuda.device_count() >= p and not has_tied(program):
        return {s: torch.device("cuda", s) for s in range(p)}
    return {s: device for s in range(p)}


def _retarget_devices(module: nn.Module, traced_on: torch.device | None,
                      device: torch.device) -> None:
    """Point the devices the trace baked into a stage's graph at the stage's ``device``.

    torch.export writes the device it traced on into factory calls and casts
    (``arange(..., device=cpu)``, ``to(device=cpu)``, ``_assert_tensor_metadata``): a host
    model traced on the first step, then placed on a GPU, would otherwise make its position
    ids on the host and assert its activations are there. fx graphs read ``x.device`` at run
    time and hold none. Delayed-init models (meta weights) traced on the inputs' device."""
    if not isinstance(module, torch.fx.GraphModule) or traced_on in (None, device):
        return
    changed = False

    def swap(arg: Any) -> Any:
        nonlocal changed
        if isinstance(arg, torch.device) and arg == traced_on:
            changed = True
            return device
        return arg

    for node in module.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, swap)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
    if changed:
        module.recompile()


def _materialise(module: nn.Module, device: torch.device, initialize: bool) -> None:
    """Place one stage's parameters on ``device``; meta (delayed-init) ones are created there.

    Delayed initialisation (``smp.delay_param_initialization``): the stage's modules get
    ``to_empty`` then ``reset_parameters`` (``smp_fx.delayed_init.materialize``), so only
    this rank's stage is ever allocated. The values then differ from an eagerly built model
    with the same seed (the RNG stream is consumed per stage, not for the whole model);
    tied replicas on several ranks are made equal by a broadcast from the first owner.
    """
    if is_delayed(module):
        (materialize if initialize else allocate)(module, device)
        return
    module.to(device)
