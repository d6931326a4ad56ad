"""``compile_model``: the one readable list of compile passes, from a module to a plan::

    trace -> shape_prop -> annotate_costs -> [mark_regions] -> (assign_manual |
    auto_partition) -> [settle_regions] -> build_plan

Each pass is pure and runs through ``passes.runner``. See docs/architecture.md, 'The data
flow'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from cost_model import roofline
from cost_model.device import DeviceSpec
from cost_model.devices import DEFAULT_DEVICE, load_device
from cost_model.errors import SMPError
from passes import meta
from passes.annotate_costs import annotate_costs
from passes.assign_manual import assign_manual, backward_edge
from passes.auto_partition import partition_graph
from passes.checkpoint_regions import keep_whole, mark_regions, settle_regions
from passes.context_parallel import ContextParallelPlan, context_parallel
from passes.manual_chunks import manual_chunks
from passes.partition_config import PartitionConfig
from passes.partitioning.baselines import BASELINES, run_baseline
from passes.partitioning.extract import problem_from_graph, write_stages
from passes.partitioning.problem import make_objective
from passes.plan import PartitionPlan, build_plan
from passes.reprice_gemms import reprice_gemms
from passes.runner import Pass, run_passes
from passes.shape_prop import shape_prop
from passes.tensor_parallel import TensorParallelism, TensorParallelPlan, tensor_parallel
from passes.trace import Frontend, trace

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Compiled:
    """The staged, costed graph and its plan (``gm`` carries every ``smp.*`` key)."""

    gm: torch.fx.GraphModule
    plan: PartitionPlan
    device: DeviceSpec
    tp_plan: TensorParallelPlan | None = None
    cp_plan: ContextParallelPlan | None = None


def resolve_device(device: str | DeviceSpec) -> DeviceSpec:
    """A spec, a built-in spec name or a spec file (``smp-fx calibrate -o FILE.json``)."""
    return device if isinstance(device, DeviceSpec) else load_device(device)


def _announced(passes: Sequence[Pass], progress: Progress | None) -> list[Pass]:
    """The passes, each reporting its name to ``progress`` before it runs."""
    if progress is None:
        return list(passes)

    def wrap(p: Pass) -> Pass:
        def fn(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
            progress(p.name)
            return p.fn(gm)

        return dataclasses.replace(p, fn=fn)

    return [wrap(p) for p in passes]


def compile_model(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
                  pconfig: PartitionConfig, *, device: str | DeviceSpec = DEFAULT_DEVICE,
                  frontend: Frontend = "auto", pins: Mapping[str, int] | None = None,
                  measured: Mapping[str, Sequence[float | None]] | None = None,
                  leaf_modules: Sequence[Any] = (),
                  progress: Progress | None = None,
                  traced: torch.fx.GraphModule | None = None,
                  tp: TensorParallelism | None = None,
                  allow_real_run: bool = True, cp: int = 1,
                  cp_local_outputs: bool = False) -> Compiled:
    """Trace, cost and partition ``model`` for one microbatch ``(args, kwargs)``.

    ``allow_real_run=False`` (SMP's ``skip_tracing``) refuses shape propagation's real-run
    fallback and the costing of a leaf on real zeros; ``Compiled.gm`` is what
    ``passes.split_stages`` splits.

    >>> from passes.partition_config import PartitionConfig
    >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> c = compile_model(m, (torch.randn(2, 4),), None, PartitionConfig(num_stages=2))
    >>> len(c.plan.stages)
    2
    """
    spec = resolve_device(device)
    costed = analyse(model, args, kwargs, device=spec, frontend=frontend, measured=measured,
                     leaf_modules=leaf_modules, progress=progress, traced=traced,
                     allow_real_run=allow_real_run)
    return partition(costed, pconfig, device=spec, pins=pins, progress=progress, tp=tp,
                     cp=cp, cp_local_outputs=cp_local_outputs)


def analyse(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
            *, device: str | DeviceSpec = DEFAULT_DEVICE, frontend: Frontend = "auto",
            measured: Mapping[str, Sequence[float | None]] | None = None,
            leaf_modules: Sequence[Any] = (),
            progress: Progress | None = None,
            traced: torch.fx.GraphModule | None = None,
            allow_real_run: bool = True) -> torch.fx.GraphModule:
    """The first half of ``compile_model``: trace -> shape_prop -> annotate_costs, apart so one
    costed graph serves many configurations; with ``traced`` the runtime's own graph is
    costed, measured and split."""
    spec = resolve_device(device)
    kw = dict(kwargs or {})
    passes = [] if traced is not None else [
        Pass("trace", lambda _: trace(model, tuple(args), kw, frontend, tuple(leaf_modules)),
             (), (meta.MODULE_PATH, meta.PARAMS))]
    passes += [
        Pass("shape_prop", lambda gm: shape_prop(gm, tuple(args), kw,
                                                 allow_real_run=allow_real_run),
             (meta.MODULE_PATH,), (meta.TENSOR,)),
        Pass("annotate_costs", lambda gm: annotate_costs(gm, spec, measured, allow_real_run),
             (meta.TENSOR,), (meta.COST,)),
    ]
    # without ``traced`` the front end turns the empty graph into the model's graph
    start = traced if traced is not None else torch.fx.GraphModule(nn.Module(), torch.fx.Graph())
    return run_passes(start, _announced(passes, progress))


def partition(costed: torch.fx.GraphModule, pconfig: PartitionConfig, *,
              device: str | DeviceSpec = DEFAULT_DEVICE, pins: Mapping[str, int] | None = None,
              progress: Progress | None = None,
              tp: TensorParallelism | None = None, cp: int = 1,
              cp_local_outputs: bool = False) -> Compiled:
    """The second half of ``compile_model``: stages, then the tp rewrite, then the cp
    rewrite (``cp`` > 1 splits the sequence over that many ranks; ``cp_local_outputs``
    leaves the outputs each rank's tokens), then the plan; stages
    are chosen on the unsharded graph, so every tp rank splits alike."""
    spec = resolve_device(device)
    strategy = ["manual"]
    placement: list[tuple[int, ...]] = []

    def comm_time(nbytes: float) -> float:
        return roofline.comm_time(nbytes, spec)

    def auto(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        new, result = partition_graph(gm, pconfig, comm_time)
        strategy[0] = result.strategy
        return keep_whole(new, pconfig, comm_time) if pconfig.checkpointing else new

    def manual(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        ranked = assign_manual(gm, dict(pins or {}), pconfig.default_partition,
                               pconfig.num_stages, check_forward=False)
        # pins name ranks; a rank holds several chunks at v > 1, or when the model's
        # modules come back to it after a later rank's (a value would go back)
        if pconfig.virtual_stages == 1 and backward_edge(ranked) is None:
            return ranked
        new, where = manual_chunks(ranked, pconfig.num_stages, pconfig.virtual_stages)
        placement.append(where)
        return new

    passes = [Pass("auto_partition", auto, (meta.COST,), (meta.STAGE,)) if pconfig.auto_partition
              else Pass("assign_manual", manual, (meta.COST,), (meta.STAGE,))]
    if pconfig.checkpointing:
        rules = pconfig.checkpointing
        passes.insert(0, Pass("mark_regions", lambda gm: mark_regions(gm, rules),
                              (meta.COST, meta.SAVED), ()))
        passes.append(Pass("settle_regions",
                           lambda gm: settle_regions(gm, not pconfig.auto_partition),
                           (meta.STAGE,), ()))
    tp_plan: list[TensorParallelPlan] = []

    def shard(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        assert tp is not None
        new, made = tensor_parallel(gm, tp, comm_time)
        tp_plan.append(made)
        return reprice_gemms(new, spec)

    if tp is not None and tp.size > 1:
        passes.append(Pass("tensor_parallel", shard, (meta.STAGE,), (meta.STAGE,)))
    cp_plan: list[ContextParallelPlan] = []

    def split_sequence(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        new, made = context_parallel(gm, cp, cp_local_outputs)
        cp_plan.append(made)
        return new

    if cp > 1:
        passes.append(Pass("context_parallel", split_sequence, (meta.STAGE,), (meta.STAGE,)))
    gm = run_passes(costed, _announced(passes, progress))
    if progress is not None:
        progress("build_plan")
    plan = build_plan(gm, pconfig, spec, comm_time, strategy[0],
                      placement[0] if placement else None)
    return Compiled(gm, plan, spec, tp_plan[0] if tp_plan else None,
                    cp_plan[0] if cp_plan else None)


@dataclass(frozen=True)
class BaselineResult:
    """A reference partitioner's plan on the same graph and costs (None: not applicable)."""

    name: str
    plan: PartitionPlan | None
    error: str = ""


def baseline_plans(compiled: Compiled) -> list[BaselineResult]:
    """Every baseline of ``passes.partitioning.baselines`` as a full plan (same objective)."""
    gm, cfg = compiled.gm, compiled.plan.config

    def comm_time(nbytes: float) -> float:
        return roofline.comm_time(nbytes, compiled.device)

    problem = problem_from_graph(gm)
    objective = make_objective(problem, cfg, comm_time)
    out = []
    for name in BASELINES:
        try:
            stage = run_baseline(name, problem, objective)
        except SMPError as exc:  # a baseline that cannot handle this graph is reported
            out.append(BaselineResult(name, None, f"{type(exc).__name__}: {exc}"))
            continue
        staged = write_stages(gm, dict(zip(problem.names, (int(s) for s in stage))))
        out.append(BaselineResult(name, build_plan(staged, cfg, compiled.device, comm_time,
                                                   name)))
    return out

