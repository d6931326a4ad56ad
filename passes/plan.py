"""``PartitionPlan``: what the partitioner decided and why, as one frozen, JSON-stable value.

A plan is a pure function of (graph, costs, config): ``build_plan`` reads the ``smp.stage``
and ``smp.cost`` metadata the compile passes wrote and summarises every stage (its nodes,
modules, parameters, FLOPs, time, memory and the tensors crossing its boundaries), the
objective the partitioner minimised with its lower bound, and what the schedule simulator
(``cost_model.simulate``) predicts for one training step: the pipeline's makespan
(``pipeline_time_s``), then each stage's optimizer step and the sums of replicated
gradients, plus the runtime's fixed cost per step (``step_time_s``), all priced by the
plan's device spec. The JSON form is deterministic
(sorted keys, floats rounded to 10 significant digits when the plan is built) so golden
files compare exactly and ``from_json(to_json(p)) == p``.

The objective is SMP's (docs/architecture.md), evaluated by the partitioner's own code
(``passes.partitioning.problem``): stage cost = ``(1 - w) * time_s / time_total + w *
memory_s / memory_total`` with ``w`` = memory_weight; ``objective`` is the largest stage
cost and ``lower_bound`` = max(sum of node costs / stages, largest node cost) in the same
units. ``StagePlan.memory`` is the finer breakdown the runtime needs (buffers carry no
gradient or optimizer state; tied names of one tensor count once per stage).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.fx

from cost_model import roofline
from cost_model.device import DeviceSpec
from cost_model.devices import DEFAULT_DEVICE, load_device
from cost_model.errors import SMPPartitionError
from cost_model.memory import ModelState, model_state
from cost_model.node_cost import NodeCost
from cost_model.schedule import SPLIT_BACKWARD
from cost_model.simulate import SimResult
from passes import meta
from passes.auto_partition import summarize
from passes.checkpoint_regions import stage_activations
from passes.partition_config import PartitionConfig
from passes.partitioning.extract import problem_from_graph
from passes.partitioning.problem import make_objective
from passes.plan_schema import (
    OPTIONAL,
    SCHEMA_VERSION,
    SHARED_HANDLING,
    BoundaryTensor,
    MemoryBreakdown,
    PartitionPlan,
    RankPlan,
    SharedParam,
    StagePlan,
    _r,
    _to_json,
)
from passes.weight_grads import weight_grads

__all__ = ["OPTIONAL", "SCHEMA_VERSION", "SHARED_HANDLING", "BoundaryTensor", "MemoryBreakdown",
           "PartitionPlan", "RankPlan", "SharedParam", "StagePlan", "build_plan",
           "summarise_modules"]



def summarise_modules(paths: Sequence[str]) -> tuple[str, ...]:
    """Short, ordered names for a stage's modules: ``h.0`` .. ``h.3`` become ``h.[0-3]``.

    Each path is cut after its first numeric component (a layer of a ModuleList or
    Sequential), else after three components; runs of consecutive layer indices under one
    parent are then merged.
    """
    heads: list[str] = []
    for path in paths:
        parts = path.split(".") if path else ["<root>"]
        cut = next((i + 1 for i, part in enumerate(parts) if part.isdigit()), min(3, len(parts)))
        head = ".".join(parts[:cut])
        if head not in heads:
            heads.append(head)
    out: list[str] = []
    run: list[int] = []
    parent = None

    def flush() -> None:
        if run:
            lo, hi = run[0], run[-1]
            pre = f"{parent}." if parent else ""
            out.append(f"{pre}{lo}" if lo == hi else f"{pre}[{lo}-{hi}]")
            run.clear()

    for head in heads:
        par, _, last = head.rpartition(".")
        if last.isdigit() and par == parent and run and int(last) == run[-1] + 1:
            run.append(int(last))
            continue
        flush()
        if last.isdigit():
            parent, run = par, [int(last)]
        else:
            parent = None
            out.append(head)
    flush()
    return tuple(out)


def _node_stages(gm: torch.fx.GraphModule, num_stages: int) -> dict[torch.fx.Node, int]:
    stages: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        stage = meta.STAGE.get(node)
        if stage is None and node.op == "output":
            stage = max((stages[a] for a in node.all_input_nodes), default=0)
        elif stage is None and node.op in ("placeholder", "get_attr") and not node.users:
            stage = 0
        if stage is None:
            raise SMPPartitionError.build(
                "build_plan needs smp.stage on every node", node.format_node(),
                f"module {meta.MODULE_PATH.get(node, '?')!r}",
                "run auto_partition or assign_manual before build_plan")
        if not 0 <= stage < num_stages:
            raise SMPPartitionError.build(f"a stage index lies in [0, {num_stages})", stage,
                                          node.format_node(), "re-run the partitioner")
        stages[node] = stage
    return stages


def _cost(node: torch.fx.Node) -> NodeCost:
    cost = meta.COST.get(node)
    if cost is None:
        if node.op in ("placeholder", "get_attr", "output"):
            return NodeCost()
        raise SMPPartitionError.build("build_plan needs smp.cost on every computing node",
                                      node.format_node(), "passes.plan.build_plan",
                                      "run annotate_costs before build_plan")
    return cost


def _tensor_infos(node: torch.fx.Node) -> list[tuple[str, tuple[int, ...], str, int]]:
    info = meta.TENSOR.get(node)
    if isinstance(info, tuple):
        items = [(f"{node.name}[{i}]", x) for i, x in enumerate(info)]
    else:
        items = [(node.name, info)]
    return [(name, tuple(x.shape), str(x.dtype), int(x.nbytes)) if x is not None
            else (name, (), "non-tensor", 0) for name, x in items]


def _boundaries(stages: Mapping[torch.fx.Node, int]) -> list[BoundaryTensor]:
    out: list[BoundaryTensor] = []
    for node, producer in stages.items():
        if node.op in ("get_attr", "output"):
            continue  # parameters are reported as shared params, not as activations
        later = sorted({stages[u] for u in node.users if stages[u] != producer})
        if not later:
            continue
        if later[0] < producer:
            user = next(u for u in node.users if stages[u] < producer)
            raise SMPPartitionError.build(
                "stages are contiguous: a value only flows to later stages",
                f"{node.name} (stage {producer}) -> {user.name} (stage {stages[user]})",
                f"module {meta.MODULE_PATH.get(user, '?')!r}",
                "move the consumer to a later stage or the producer to an earlier one")
        for name, shape, dtype, nbytes in _tensor_infos(node):
            out.append(BoundaryTensor(name, shape, dtype, nbytes, producer, tuple(later)))
    return out


def _param_table(gm: torch.fx.GraphModule) -> dict[str, tuple[int, int, bool]]:
    """name -> (tensor id, bytes, is a trainable parameter); tied names share the id."""
    table: dict[str, tuple[int, int, bool]] = {}
    for name, t in gm.named_parameters(remove_duplicate=False):
        table[name] = (id(t), t.numel() * t.element_size(), t.requires_grad)
    for name, buf in gm.named_buffers(remove_duplicate=False):
        table[name] = (id(buf), buf.numel() * buf.element_size(), False)
    return table


def build_plan(gm: torch.fx.GraphModule, pconfig: PartitionConfig,
               device: DeviceSpec | None = None,
               comm_time: Callable[[float], float] | None = None,
               strategy: str = "given", placement: Sequence[int] | None = None
               ) -> PartitionPlan:
    """Summarise a staged, costed graph as a ``PartitionPlan`` (the graph is only read).

    ``device`` is the ``cost_model.device.DeviceSpec`` the costs were computed for (recorded
    by its ``to_json``; default: the spec ``pconfig.device`` names, else
    ``DEFAULT_DEVICE``); ``comm_time(nbytes)`` prices boundary transfers (default: the
    spec's link model); ``strategy`` records how the stages were chosen. Stage costs,
    objective and lower bound come from ``passes.partitioning.problem`` (the objective the
    partitioner minimised); the memory breakdown, boundaries and FLOPs are summed here.
    With ``virtual_stages`` > 1 the plan's stages are the chunks (``smp.stage`` holds the
    chunk), ``placement`` gives each chunk's rank (default: the pipeline's,
    ``PartitionConfig.placement``; a manual partition's may hold more chunks on one rank
    than on another, ``passes.manual_chunks``) and ``ranks`` each rank's memory; with a
    split backward (``zero_bubble``, ``zbv``) each chunk also carries its W's time and held
    bytes.
    Example, after the compile passes::

        plan = build_plan(gm, PartitionConfig(num_stages=2), get_device("a100"))
    """
    spec = device if device is not None else load_device(pconfig.device or DEFAULT_DEVICE)
    comm = comm_time or functools.partial(roofline.comm_time, spec=spec)
    rank_of = tuple(placement) if placement is not None else pconfig.placement
    p = len(rank_of)
    split = pconfig.pipeline in SPLIT_BACKWARD
    stages = _node_stages(gm, p)
    table = _param_table(gm)
    members: list[list[torch.fx.Node]] = [[] for _ in range(p)]
    for node, s in stages.items():
        members[s].append(node)

    # parameters: per stage (tied names deduplicated by tensor) and the shared ones
    readers: dict[int, list[int]] = {}
    names_of: dict[int, list[str]] = {}
    stage_params: list[list[str]] = [[] for _ in range(p)]
    for node, s in stages.items():
        for name in meta.PARAMS.get(node, ()) or ():
            if name not in table:
                raise SMPPartitionError.build(
                    "smp.params names a tensor the graph module does not hold", name,
                    node.format_node(), "trace with passes.trace so names are original FQNs")
            tid = table[name][0]
            names_of.setdefault(tid, [])
            if name not in names_of[tid]:
                names_of[tid].append(name)
            if s not in readers.setdefault(tid, []):
                readers[tid].append(s)
            if name not in stage_params[s]:
                stage_params[s].append(name)
    bytes_of = {tid: nbytes for tid, nbytes, _ in table.values()}
    trainable = {tid: grad for tid, _, grad in table.values()}
    trainable_names = {name for name, (_, _, grad) in table.items() if grad}

    numel_of = {id(t): t.numel() for _, t in gm.named_parameters(remove_duplicate=False)}
    thr = pconfig.persistence_threshold

    def static_of(tids: set[int]) -> tuple[int, int, int, int]:
        elems = [numel_of[t] for t in tids if trainable[t]]
        state = _state(pconfig, sum(elems), len(elems), sum(n for n in elems if n < thr))
        buf = sum(bytes_of[t] for t in tids if not trainable[t])
        return state.params, state.grads, state.optimizer, buf

    boundaries = _boundaries(stages)
    costs = {n: _cost(n) for n in stages}
    # the partitioner's own objective, so plan and partitioner can never disagree
    problem = problem_from_graph(gm)
    objective_fn = make_objective(problem, pconfig, comm, placement=rank_of)
    by_name = {n.name: s for n, s in stages.items()}
    scored = summarize(problem, objective_fn,
                       np.asarray([by_name[x] for x in problem.names], dtype=np.int64), strategy)
    inflight = list(objective_fn.inflight)

    stage_plans: list[StagePlan] = []
    for s in range(p):
        nodes = members[s]
        tids = {table[n][0] for n in stage_params[s]}
        par, grad, opt_b, buf = static_of(tids)
        step_s = spec.optimizer_time(sum(1 for t in tids if trainable[t]), par)
        acts = stage_activations(nodes)
        off = acts.region_inputs if pconfig.offload_activations else 0
        saved = acts.saved - off
        wg = weight_grads(nodes, trainable_names, acts.rebuilt) if split else None
        mem = MemoryBreakdown(par, grad, opt_b, buf, saved, inflight[s], saved * inflight[s],
                              par + grad + opt_b + buf + saved * inflight[s] + acts.transient,
                              acts.transient, off,
                              saved + off + wg.held_bytes if wg is not None else 0)
        fwd_t = sum(costs[n].fwd_time_s for n in nodes)
        bwd_t = sum(costs[n].bwd_time_s for n in nodes)
        recompute_s = sum(costs[n].fwd_time_s for n in nodes if meta.CKPT_REGION.has(n))
        comm_s = scored.stages[s].comm_time_s
        link_s = scored.stages[s].link_time_s
        full = tuple(dict.fromkeys(meta.MODULE_PATH.get(n, "") or "" for n in nodes
                                   if n.op not in ("placeholder", "output")))
        paths = [x for x in full if x] or list(full)
        stage_plans.append(StagePlan(
            index=s, nodes=tuple(n.name for n in nodes), modules=summarise_modules(paths),
            module_paths=tuple(x for x in full if x), params=tuple(stage_params[s]),
            param_bytes=par + buf,
            fwd_flops=_r(sum(costs[n].fwd_flops for n in nodes)),
            bwd_flops=_r(sum(costs[n].bwd_flops for n in nodes)),
            fwd_time_s=_r(fwd_t), bwd_time_s=_r(bwd_t), comm_time_s=_r(comm_s),
            link_time_s=_r(link_s), time_s=_r(max(fwd_t + bwd_t, link_s)),
            out_bytes=int(scored.stages[s].comm_bytes),
            memory=mem,
            received=tuple(b for b in boundaries if s in b.consumers),
            sent=tuple(b for b in boundaries if b.producer == s),
            cost=_r(scored.stages[s].cost), optimizer_time_s=_r(step_s),
            checkpointed=acts.regions, recompute_time_s=_r(recompute_s),
            wgrad_time_s=_r(min(wg.time_s, bwd_t)) if wg is not None else 0.0))

    objective = max(sp.cost for sp in stage_plans)
    tied = [t for t in readers if len(readers[t]) > 1]
    shared = tuple(SharedParam(tuple(names_of[t]), bytes_of[t], tuple(sorted(readers[t])),
                               _handling(sorted(readers[t]), rank_of)) for t in tied)
    copy_bytes = [_state(pconfig, numel_of[t], 1, numel_of[t] if numel_of[t] < thr else 0).total
                  if trainable[t] else bytes_of[t] for t in tied]
    plan = PartitionPlan(
        config=pconfig, device=_to_json(spec.to_json()), stages=tuple(stage_plans),
        objective=_r(objective), lower_bound=_r(scored.lower_bound), strategy=strategy,
        bottleneck_stage=max(range(p), key=lambda i: (stage_plans[i].cost, -i)),
        step_time_s=0.0, bubble_fraction=0.0, shared_params=shared,
        time_total_s=_r(objective_fn.time_total),
        memory_total_bytes=int(round(objective_fn.memory_total)),
        placement=rank_of if rank_of != tuple(range(p)) else ())
    sim = plan.simulate()
    detail = bool(plan.placement) or split
    return dataclasses.replace(plan, step_time_s=_r(plan.training_step_s(sim)),
                               pipeline_time_s=_r(sim.step_time_s),
                               bubble_fraction=_r(sim.bubble_fraction),
                               ranks=_rank_plans(plan, sim, copy_bytes) if detail else (),
                               bubble_rate=_r(sim.bubble_rate) if detail else 0.0)


def _state(config: PartitionConfig, elems: int, tensors: int, whole: int) -> ModelState:
    """The model state of ``elems`` trainable elements in ``tensors`` tensors on one rank
    (``cost_model.memory.model_state``, the planner's count)."""
    return model_state(elems, precision=config.precision, zero=config.zero,
                       dp=config.data_parallel_degree, tensors=tensors, whole=whole,
                       optimizer_factor=float(config.optimizer_state_factor))


def _handling(chunks: Sequence[int], rank_of: Sequence[int]) -> str:
    """How a parameter read by several chunks is held: one copy when they share a rank."""
    ranks = sorted({rank_of[c] for c in chunks})
    if len(ranks) == 1:
        return (f"one copy on rank {ranks[0]}, shared by its chunks; gradients accumulate "
                "in place")
    return SHARED_HANDLING


def _rank_plans(plan: PartitionPlan, sim: SimResult, copy_bytes: Sequence[int]
                ) -> tuple[RankPlan, ...]:
    """Each rank's chunks and memory: the chunks' static bytes (a parameter two of its
    chunks read counted once: ``copy_bytes`` of each shared one), the simulated peak of
    what they keep for backward (a pending W holding its share), their largest transient."""
    out = []
    for r in range(plan.num_ranks):
        chunks = tuple(c for c, owner in enumerate(plan.rank_of) if owner == r)
        mems = [plan.stages[c].memory for c in chunks]
        static = sum(m.params + m.grads + m.optimizer_state + m.buffers for m in mems)
        for sh, one in zip(plan.shared_params, copy_bytes):
            copies = sum(1 for c in sh.stages if plan.rank_of[c] == r)
            static -= max(copies - 1, 0) * one
        transient = max((m.recompute_transient for m in mems), default=0)
        static_sim = sum(plan.stages[c].memory.total - plan.stages[c].memory.activations
                         for c in chunks)
        acts = sim.peak_memory_bytes[r] - static_sim
        out.append(RankPlan(r, chunks, static, acts, static + acts + transient))
    return tuple(out)
