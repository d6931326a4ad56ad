"""Running a stage's checkpointed regions under non-reentrant ``torch.utils.checkpoint``.

Each region becomes one call; the stage keeps its parameters and names (the region's
module is not registered, so nothing is listed twice). Under a split backward regions
use ``recompute_once`` instead. See docs/memory.md, 'At run time'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.fx
import torch.utils.checkpoint

from cost_model.errors import SMPConfigError
from cost_model.schedule import SPLIT_BACKWARD
from passes import meta
from passes.checkpoint_regions import COMPUTE, region_inputs
from passes.plan import PartitionPlan
from smp_fx.runtime.executor.seams import StageRunner, StepHooks
from smp_fx.runtime.memory.activations import ActivationKeeper, region_hooks
from smp_fx.runtime.memory.recompute_once import checkpoint_once


class RegionCall:
    """One checkpointed region: ``call(*inputs)`` returns the region's outputs as a tuple."""

    def __init__(self, name: str, module: torch.fx.GraphModule,
                 preserve_rng_state: bool, once: bool = False) -> None:
        self.name = name
        self.module = module
        self.preserve_rng_state = preserve_rng_state
        self.once = once  # a split backward: rebuild once for its I and W (recompute_once)
        self.__name__ = "checkpoint_" + "".join(c if c.isalnum() else "_" for c in name)

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        # the generated forward itself, not the GraphModule's call: torch stops each
        # recomputation early by raising, and the call's error formatting (a traceback
        # extracted, source files read) would cost ~0.5 ms every time
        run = self.module.forward
        if not torch.is_grad_enabled():
            return tuple(run(*inputs))
        with region_hooks():  # the region's inputs are saved here, its insides by torch
            if self.once:
                return tuple(checkpoint_once(run, *inputs,
                                             preserve_rng_state=self.preserve_rng_state))
            return tuple(torch.utils.checkpoint.checkpoint(
                run, *inputs, use_reentrant=False, preserve_rng_state=self.preserve_rng_state))

    def __repr__(self) -> str:
        return f"RegionCall({self.name!r})"


class ActivationCheckpointing:
    """Activation checkpointing and offloading on this rank's stages (a build step); the
    executor drives the keepers it gives."""

    name: ClassVar[str] = "activation_checkpointing"

    def __init__(self, plan: PartitionPlan, runners: Mapping[int, StageRunner],
                 offload: bool) -> None:
        if offload and not any(st.checkpointed for st in plan.stages):
            raise SMPConfigError.build(
                "'offload_activations' moves checkpointed regions' inputs, and no module "
                "is checkpointed", True, "smp.DistributedModel (first smp.step)",
                "call smp.set_activation_checkpointing(module) before the first step, or "
                "drop 'offload_activations'")
        self.keepers: dict[int, ActivationKeeper] = {}
        once = plan.config.pipeline in SPLIT_BACKWARD
        for s, r in sorted(runners.items()):
            outline_regions(r.stage.module, once)
            state_tensors = [*r.stage.module.parameters(), *r.stage.module.buffers()]
            self.keepers[s] = ActivationKeeper(state_tensors, offload=offload)

    def hooks(self) -> StepHooks:
        return StepHooks()


def outline_regions(module: torch.fx.GraphModule, once: bool = False) -> list[RegionCall]:
    """Rewrite ``module``'s graph in place: each region's nodes become one region call;
    readers of its outputs move after it. Returns the calls, in order."""
    graph = module.graph
    members: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        region = meta.CKPT_REGION.get(node)
        if region is not None and node.op in COMPUTE:  # a received value keeps its meta
            members.setdefault(region.name, []).append(node)
    calls = []
    for name, nodes in members.items():
        calls.append(_outline(module, name, nodes, once))
    if calls:
        graph.lint()
        module.recompile()
    return calls


def _outline(module: torch.fx.GraphModule, name: str,
             nodes: list[torch.fx.Node], once: bool) -> RegionCall:
    graph = module.graph
    inside = set(nodes)
    inputs = region_inputs(nodes)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for m in inputs:
        env[m] = sub.placeholder(m.name)
    for n in nodes:
        for m in n.all_input_nodes:
            if m.op == "get_attr" and m not in env:
                env[m] = sub.node_copy(m, env.__getitem__)
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    region = meta.CKPT_REGION.get(nodes[0])
    call_obj = RegionCall(name, torch.fx.GraphModule(module, sub, class_name="Region"),
                          region.preserve_rng_state, once)
    # outside nodes after the first region node that read it move after the call
    later: list[torch.fx.Node] = []
    moved: set[torch.fx.Node] = set()
    walking = False
    for n in list(graph.nodes):
        if n is nodes[0]:
            walking = True
        if n is nodes[-1]:
            break
        if walking and n not in inside and any(m in inside or m in moved
                                               for m in n.all_input_nodes):
            later.append(n)
            moved.add(n)
    anchor = nodes[-1]
    with graph.inserting_after(anchor):
        call = graph.call_function(call_obj, tuple(inputs))
    point = call
    for i, n in enumerate(outputs):
        with graph.inserting_after(point):
            point = graph.call_function(_item, (call, i))
        point.meta = dict(n.meta)
        point.meta.pop(meta.CKPT_REGION.name, None)
        n.replace_all_uses_with(point, delete_user_cb=lambda u: u not in inside)
    for n in later:
        point.append(n)
        point = n
    for n in reversed(nodes):
        graph.erase_node(n)
    return call_obj


def _item(values: tuple[Any, ...], index: int) -> Any:
    return values[index]
