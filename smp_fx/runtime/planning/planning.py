"""The first step's plan on this rank: trace once, cost, partition, agree across ranks.

What can differ between ranks (the device spec, measured costs, finally each node's
stage) is decided on world rank 0 and broadcast; the rest is deterministic.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from cost_model.device import DeviceSpec
from cost_model.devices import DEFAULT_DEVICE, load_device, spec_for_device_name
from cost_model.errors import SMPConfigError, SMPPartitionError, SMPTracingError, not_implemented
from cost_model.measure import measure_nodes
from passes import meta
from passes.plan import PartitionPlan
from passes.tensor_parallel import TensorParallelPlan
from passes.trace import trace
from smp_fx.runtime.executor.modes import Autocast, thread_modes
from smp_fx.runtime.planning.plan_request import plan_request
from smp_fx.runtime.planning.shared_export import host_share
from smp_fx.world import state

log = logging.getLogger("smp_fx.planning")


def plan_stages(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                times: bool, memory: bool, autocast: Autocast, st: state.State
                ) -> tuple[torch.fx.GraphModule, PartitionPlan, TensorParallelPlan | None]:
    """Trace once, cost and partition; (GraphModule with STAGE, plan), a pure function of the
    model, first microbatch, configuration (``st``, what ``smp.init`` established) and spec."""
    cfg = st.config
    args, kwargs = on_module_device(module, (args, kwargs))
    weights = weights_device(module) or st.device
    if times and weights.type != st.device.type:
        raise not_implemented(
            f"timing nodes on {st.device.type} while the weights are on {weights}",
            "trace_execution_times",
            "the weights stay where the model was built until the plan places each stage, "
            "so the times would be the host's: build the model on the device (it must fit "
            "there), or leave trace_execution_times False (the analytic costs of this "
            "device's spec; `smp-fx calibrate` on it measures one)")
    device = plan_device(st)
    # context parallelism reads the sequence length as a symbol, which only export keeps
    gm = trace(module, args, kwargs, "export" if cfg.context_parallel_degree > 1 else "auto",
               share=host_share(st))
    measured = None
    if times or memory:
        with thread_modes(torch.is_grad_enabled(), autocast):
            measured = measured_costs(gm, args, kwargs, times, memory, st)
    # after the trace: smp.checkpoint inside the forward marks its module while traced
    request = plan_request(cfg, module, device, st.axis_rank("tp"),
                           data_parallel_degree=st.axis_size("rdp"))
    try:
        with thread_modes(torch.is_grad_enabled(), autocast):
            compiled = request.compile(module, args, kwargs, measured=measured, traced=gm)
    except SMPTracingError as exc:
        if request.real_run:
            raise
        raise SMPTracingError(f"{exc} ('skip_tracing': true refused the one real forward "
                              "that would measure these shapes: drop 'skip_tracing', or "
                              "make the module a leaf)") from exc
    if compiled.cp_plan is not None and st.rank == 0:
        log.info("smp-fx %s", compiled.cp_plan.text())
    return compiled.gm, compiled.plan, compiled.tp_plan


def weights_device(module: nn.Module) -> torch.device | None:
    """Where ``module``'s weights are; None if all of them are meta (delayed init)."""
    return next((t.device for t in [*module.parameters(), *module.buffers()]
                 if t.device.type != "meta"), None)


def on_module_device(module: nn.Module, value: Any) -> Any:
    """``value``'s tensors on the device of ``module``'s weights, for tracing: SMP scripts put
    the batch on the GPU of a host-built model, whose stages move only after planning."""
    device = weights_device(module)
    if device is None:
        return value
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t if t.device == device else t.to(device), value)


DEVICE_SPEC_ENV = "SMP_FX_DEVICE_SPEC"


def plan_device(st: state.State) -> DeviceSpec:
    """The ``DeviceSpec`` to plan for, resolved on world rank 0 and broadcast (an error too,
    so every rank raises it); ``SMP_FX_DEVICE_SPEC`` wins (docs/parameters.md)."""
    box: list[Any] = [None]
    if st.rank == 0:
        name = os.environ.get(DEVICE_SPEC_ENV)
        if not name and st.device.type == "cuda":
            gpu = torch.cuda.get_device_name(st.device)
            name = spec_for_device_name(gpu)
            if name is None:
                log.warning("no built-in device spec for %r: planning for %r; set %s to a "
                            "spec file from `smp-fx calibrate` to plan for this GPU", gpu,
                            DEFAULT_DEVICE, DEVICE_SPEC_ENV)
                name = DEFAULT_DEVICE
        try:
            box = [load_device(name or st.device.type).to_json()]
        except SMPConfigError as exc:
            box = [str(exc)]
    if not st.in_process and st.world_size > 1:
        dist.broadcast_object_list(box, src=0, group=st.object_group("world"))
    if isinstance(box[0], str):
        raise SMPConfigError(f"{box[0]} (from {DEVICE_SPEC_ENV} or the device, on rank 0)")
    return DeviceSpec.from_json(box[0])


def measured_costs(gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                   times: bool, memory: bool, st: state.State
                   ) -> dict[str, tuple[Any, Any, Any]]:
    """Per-node measured costs (``trace_execution_times`` / ``trace_memory_usage``), taken
    on world rank 0 and broadcast: measurements are noisy, and every rank must make the
    same plan. A field not asked for is None, so it keeps its analytic value."""
    box: list[Any] = [None]
    if st.rank == 0:
        raw = measure_nodes(gm, args, kwargs, times=times, memory=memory)
        box = [{name: (f if times else None, b if times else None, m if memory else None)
                for name, (f, b, m) in raw.items()}]
    if not st.in_process and st.world_size > 1:
        dist.broadcast_object_list(box, src=0, group=st.object_group("world"))
    return box[0]


def agree_on_plan(gm: torch.fx.GraphModule, st: state.State) -> None:
    """Adopt world rank 0's stage assignment (measured costs may differ between ranks)."""
    mine = [(n.name, meta.STAGE.get(n)) for n in gm.graph.nodes]
    box = [mine]
    dist.broadcast_object_list(box, src=0, group=st.object_group("world"))
    theirs = box[0]
    if [n for n, _ in theirs] != [n for n, _ in mine]:
        raise SMPPartitionError.build(
            "ranks traced different graphs", f"{len(theirs)} vs {len(mine)} nodes",
            f"rank {st.rank}", "make the model and first batch identical on every rank")
    for node, (_, stage) in zip(gm.graph.nodes, theirs):
        if stage is not None:
            meta.STAGE.set(node, stage)
