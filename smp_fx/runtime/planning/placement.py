"""Placing a planned model on this rank: split it, pick the transport, build the runners.

Partitioning is deciding (``planning``), placing (here) and composing the parallelisms
(``smp_fx.parallel.build``); the result is identical on every rank, as the plan is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from passes.split_stages import StagedProgram, split_stages
from smp_fx.marking.delayed_init import allocate, is_delayed, materialize
from smp_fx.runtime.executor.executor import ExecutorOptions
from smp_fx.runtime.executor.seams import StageRunner
from smp_fx.runtime.inputs.shapes import ShapeGuard, guard_for
from smp_fx.runtime.planning.planning import agree_on_plan, weights_device
from smp_fx.runtime.transport.dist_transport import DistTransport
from smp_fx.runtime.transport.transport import InProcessTransport, Transport
from smp_fx.world import launch, state


@dataclass(frozen=True)
class Placement:
    """This rank's share of the partitioned model, on its devices."""

    program: StagedProgram
    runners: dict[int, StageRunner]
    transport: Transport
    shapes: ShapeGuard
    delayed: bool
    options: ExecutorOptions

    @property
    def multi(self) -> bool:
        """The stages run in several processes (one each); else all in this one."""
        return self.options.multi_process


def multi_process(st: state.State) -> bool:
    """Whether this job's pipeline stages live in processes of their own."""
    return not st.in_process and st.axis_size("pp") > 1


def split_for_rank(gm: torch.fx.GraphModule, st: state.State, num_stages: int
                   ) -> StagedProgram:
    """The ``num_stages`` stages (the plan's chunks: p x ``virtual_pipeline_degree``, or
    what a manual partition's placement holds) of the planned ``gm``: world rank 0's stage
    of every node, on every rank (measured costs may differ between ranks, the plan must
    not)."""
    if not st.in_process and st.world_size > 1:
        agree_on_plan(gm, st)
    return split_stages(gm, num_stages)


def lanes(rank_of: Sequence[int]) -> tuple[int, ...]:
    """Each chunk's index among its rank's chunks (0 for every stage at one per rank)."""
    seen: dict[int, int] = {}
    out = []
    for r in rank_of:
        out.append(seen.get(r, 0))
        seen[r] = out[-1] + 1
    return tuple(out)


def place_stages(gm: torch.fx.GraphModule, program: StagedProgram, st: state.State,
                 rank_of: Sequence[int] | None = None, initialize: bool = True) -> Placement:
    """Place this rank's stages of ``program``; ``initialize=False`` allocates delayed-init
    stages without initialising them (their weights are loaded next)."""
    cfg = st.config
    p = cfg.pipeline_parallel_degree
    rank_of = tuple(rank_of) if rank_of is not None else tuple(range(p))
    multi = multi_process(st)
    timeout_s = launch.timeout().total_seconds()
    transport: Transport
    if multi:
        pp_rank = st.axis_rank("pp")
        local = [c for c, r in enumerate(rank_of) if r == pp_rank]
        devices = {c: st.device for c in local}
        pp_ranks = st.group_ranks("pp")
        stage_ranks = [pp_ranks[r] for r in rank_of]
        transport = DistTransport(stage_ranks, local[0], st.device, timeout_s,
                                  DistTransport.make_groups(lanes=1 + max(lanes(rank_of))),
                                  lanes(rank_of))
    else:
        local = list(range(len(rank_of)))
        devices = _in_process_devices(rank_of, st.device, program)
        transport = InProcessTransport(devices)
    runners = {s: StageRunner(program.stages[s], devices[s]) for s in local}
    delayed = any(is_delayed(r.module) for r in runners.values())
    traced_on = weights_device(gm)  # where the plan traced
    for s, r in runners.items():
        _materialise(r.module, devices[s], initialize)
        _retarget_devices(r.stage.module, traced_on, devices[s])
    options = ExecutorOptions(multi, timeout_s, st.rank,
                              tuple(stage_ranks) if multi else None,
                              cfg.activation_loading_horizon)
    return Placement(program, runners, transport, guard_for(gm, program), delayed, options)


def local_named_parameters(runners: Mapping[int, StageRunner], canonical: Mapping[str, str]
                           ) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters of the local stages, each once, by the names plain
    ``named_parameters()`` of the wrapped module gives (``canonical``: every alias of a
    tied parameter -> its first name), whichever alias its stage reads it by."""
    seen: set[int] = set()
    for s in sorted(runners):
        for name, p in runners[s].stage.module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield canonical.get(name, name), p


def _in_process_devices(rank_of: Sequence[int], device: torch.device,
                        program: StagedProgram) -> dict[int, torch.device]:
    """Rank r's stages on cuda:r when there are that many GPUs and no tied parameters, else
    every stage on one device."""
    p = 1 + max(rank_of)
    if device.type == "cuda" and torch.cuda.device_count() >= p and not _has_tied(program):
        return {s: torch.device("cuda", r) for s, r in enumerate(rank_of)}
    return {s: device for s in range(len(rank_of))}


def _retarget_devices(module: nn.Module, traced_on: torch.device | None,
                      device: torch.device) -> None:
    """Point the devices torch.export baked into a stage's graph at the stage's ``device``,
    so a host-traced model placed on a GPU makes its tensors there."""
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
    """Place one stage's parameters on ``device``; delayed-init ones are replayed there, so
    only this rank's stage is ever allocated."""
    if is_delayed(module):
        (materialize if initialize else allocate)(module, device)
        return
    module.to(device)


def _has_tied(program: StagedProgram) -> bool:
    """Whether a parameter object is read on several stages (in-process stages share it)."""
    seen: set[int] = set()
    for st in program.stages:
        ids = {id(p) for p in st.module.parameters()}
        if ids & seen:
            return True
        seen |= ids
    return False
