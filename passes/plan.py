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

The objective is DESIGN.md's, evaluated by the partitioner's own code
(``passes.partitioning.problem``): stage cost = ``(1 - w) * time_s / time_total + w *
memory_s / memory_total`` with ``w`` = memory_weight; ``objective`` is the largest stage
cost and ``lower_bound`` = max(sum of node costs / stages, largest node cost) in the same
units. ``StagePlan.memory`` is the finer breakdown the runtime needs (buffers carry no
gradient or optimizer state; tied names of one tensor count once per stage).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.fx

from cost_model import roofline
from cost_model.device import DEFAULT_DEVICE, DeviceSpec, load_device
from cost_model.errors import SMPPartitionError
from cost_model.node_cost import NodeCost
from cost_model.schedule import generate
from cost_model.simulate import SimResult, StageCost, simulate, training_step_s
from passes import meta
from passes.auto_partition import summarize
from passes.checkpoint_regions import stage_activations
from passes.partition_config import PartitionConfig
from passes.partitioning.extract import problem_from_graph
from passes.partitioning.problem import make_objective

SCHEMA_VERSION = 2
OPTIONAL = {"omit_default": True}
"""Field metadata: left out of the JSON at its default (features off read as before)."""
SHARED_HANDLING = "replicated on every stage that reads it; gradients summed across them"


def _r(x: float) -> float:
    """Round to 10 significant digits: stable JSON across summation-order noise."""
    return float(f"{float(x):.10g}")


@dataclass(frozen=True)
class BoundaryTensor:
    """A value crossing a stage boundary: produced on ``producer``, read on ``consumers``."""

    value: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    producer: int
    consumers: tuple[int, ...]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one stage needs at its peak (DESIGN.md "Costs": static + saved x in flight).

    With activation checkpointing a region keeps only its inputs (in
    ``activations_per_microbatch``); while one region is recomputed its own saved values
    exist too: the largest is ``recompute_transient``, counted once. With offloading the
    region inputs (``offloaded_per_microbatch``) leave the device after each forward and
    are not in ``activations_per_microbatch``.
    """

    params: int
    grads: int
    optimizer_state: int
    buffers: int
    activations_per_microbatch: int
    in_flight: int
    activations: int
    total: int
    recompute_transient: int = field(default=0, metadata=OPTIONAL)
    offloaded_per_microbatch: int = field(default=0, metadata=OPTIONAL)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage. Times are per microbatch.

    ``out_bytes`` is what crosses the boundary after this stage: every value produced on
    this or an earlier stage and read on a later one (values are relayed stage to stage).
    ``comm_time_s`` is one transfer of it, latency included; ``link_time_s`` how long it
    keeps the link busy. Sends overlap compute, so the stage's steady-state time is
    ``time_s = max(fwd_time_s + bwd_time_s, link_time_s)`` (architecture.md "Stage time
    model"). ``sent`` / ``received`` list the crossing values by producer.
    ``optimizer_time_s`` is the stage's optimizer step, once per training step.
    """

    index: int
    nodes: tuple[str, ...]
    modules: tuple[str, ...]
    module_paths: tuple[str, ...]
    params: tuple[str, ...]
    param_bytes: int
    fwd_flops: float
    bwd_flops: float
    fwd_time_s: float
    bwd_time_s: float
    comm_time_s: float
    link_time_s: float
    time_s: float
    out_bytes: int
    memory: MemoryBreakdown
    received: tuple[BoundaryTensor, ...]
    sent: tuple[BoundaryTensor, ...]
    cost: float
    optimizer_time_s: float = 0.0
    checkpointed: tuple[str, ...] = field(default=(), metadata=OPTIONAL)
    recompute_time_s: float = field(default=0.0, metadata=OPTIONAL)

    @property
    def flops(self) -> float:
        return self.fwd_flops + self.bwd_flops

    @property
    def sent_bytes(self) -> int:
        return sum(b.nbytes for b in self.sent)

    @property
    def received_bytes(self) -> int:
        return sum(b.nbytes for b in self.received)


@dataclass(frozen=True)
class SharedParam:
    """A parameter (or a set of tied names of one tensor) read on more than one stage."""

    names: tuple[str, ...]
    nbytes: int
    stages: tuple[int, ...]
    handling: str = SHARED_HANDLING


@dataclass(frozen=True)
class PartitionPlan:
    """The plan for one model, configuration and device. See the module docstring."""

    config: PartitionConfig
    device: Mapping[str, Any]
    stages: tuple[StagePlan, ...]
    objective: float
    lower_bound: float
    bottleneck_stage: int
    step_time_s: float
    bubble_fraction: float
    shared_params: tuple[SharedParam, ...]
    time_total_s: float
    memory_total_bytes: int
    strategy: str = "given"
    pipeline_time_s: float = 0.0
    schema_version: int = SCHEMA_VERSION

    @property
    def ratio(self) -> float:
        """Objective over its lower bound (1.0 = provably optimal)."""
        return self.objective / self.lower_bound if self.lower_bound > 0 else 1.0

    def stage_of(self, node_name: str) -> int:
        for stage in self.stages:
            if node_name in stage.nodes:
                return stage.index
        raise SMPPartitionError.build("the plan has no node of this name", node_name,
                                      "PartitionPlan.stage_of",
                                      "pass the name of a node of the planned graph")

    def spec(self) -> DeviceSpec:
        """The device spec the plan was made for (recorded in ``device``)."""
        return DeviceSpec.from_json(dict(self.device))

    def stage_costs(self) -> tuple[StageCost, ...]:
        """The simulator's view of the stages (same numbers the plan's step time used).

        Gradients cross the same boundary as the activations did, backwards; the link
        latency is what a transfer takes beyond its link time. Fixed costs per action and
        per message come from the device spec.
        """
        spec = self.spec()
        latency = max((st.comm_time_s - st.link_time_s for st in self.stages
                       if st.out_bytes > 0), default=0.0)
        out = []
        for s, st in enumerate(self.stages):
            back = self.stages[s - 1].link_time_s if s > 0 else 0.0
            static = st.memory.total - st.memory.activations
            out.append(StageCost(st.fwd_time_s, st.bwd_time_s, st.link_time_s, back, static,
                                 st.memory.activations_per_microbatch, max(latency, 0.0),
                                 spec.microbatch_overhead_s, spec.message_overhead_s))
        return tuple(out)

    def simulate(self) -> SimResult:
        """Re-run the simulator on this plan's stages and schedule."""
        c = self.config
        sched = generate(c.pipeline, c.num_stages, c.microbatches, c.active)
        return simulate(sched, self.stage_costs())

    def training_step_s(self, sim: SimResult) -> float:
        """The training step of ``sim`` (``cost_model.simulate.training_step_s``): the
        replicated gradients' all-reduce, each stage's optimizer, the fixed step cost."""
        spec = self.spec()
        sums = [(sh.stages, 2.0 * (roofline.comm_time(sh.nbytes, spec)
                                   + spec.message_overhead_s)) for sh in self.shared_params]
        return training_step_s(sim, [st.optimizer_time_s for st in self.stages], sums,
                               spec.step_overhead_s)

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    def dumps(self) -> str:
        """Deterministic text: sorted keys, one-space indent, trailing newline."""
        return json.dumps(self.to_json(), sort_keys=True, indent=1) + "\n"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PartitionPlan:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SMPPartitionError.build("unsupported PartitionPlan schema version", version,
                                          "PartitionPlan.from_json",
                                          f"re-create the plan (schema {SCHEMA_VERSION})")
        d = dict(data)
        d["config"] = PartitionConfig.from_json(d["config"])
        d["device"] = dict(d["device"])
        d["stages"] = tuple(_stage_from_json(s) for s in d["stages"])
        d["shared_params"] = tuple(SharedParam(tuple(p["names"]), p["nbytes"],
                                               tuple(p["stages"]), p["handling"])
                                   for p in d["shared_params"])
        return cls(**d)

    @classmethod
    def loads(cls, text: str) -> PartitionPlan:
        return cls.from_json(json.loads(text))


def _to_json(value: Any) -> Any:
    if isinstance(value, PartitionConfig):
        return value.to_json()
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _to_json(getattr(value, f.name)) for f in fields(value)
                if not (f.metadata.get("omit_default") and getattr(value, f.name) == f.default)}
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if isinstance(value, float):
        return _r(value)
    return value


def _boundary_from_json(b: Mapping[str, Any]) -> BoundaryTensor:
    return BoundaryTensor(b["value"], tuple(b["shape"]), b["dtype"], b["nbytes"], b["producer"],
                          tuple(b["consumers"]))


def _stage_from_json(s: Mapping[str, Any]) -> StagePlan:
    d = dict(s)
    for key in ("nodes", "modules", "module_paths", "params", "checkpointed"):
        if key in d:
            d[key] = tuple(d[key])
    d["memory"] = MemoryBreakdown(**d["memory"])
    d["received"] = tuple(_boundary_from_json(b) for b in d["received"])
    d["sent"] = tuple(_boundary_from_json(b) for b in d["sent"])
    return StagePlan(**d)


# ----------------------------------------------------------------------------- building


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
               strategy: str = "given") -> PartitionPlan:
    """Summarise a staged, costed graph as a ``PartitionPlan`` (the graph is only read).

    ``device`` is the ``cost_model.device.DeviceSpec`` the costs were computed for (recorded
    by its ``to_json``; default: the spec ``pconfig.device`` names, else
    ``DEFAULT_DEVICE``); ``comm_time(nbytes)`` prices boundary transfers (default: the
    spec's link model); ``strategy`` records how the stages were chosen. Stage costs,
    objective and lower bound come from ``passes.partitioning.problem`` (the objective the
    partitioner minimised); the memory breakdown, boundaries and FLOPs are summed here.
    Example, after the compile passes::

        plan = build_plan(gm, PartitionConfig(num_stages=2), get_device("a100"))
    """
    spec = device if device is not None else load_device(pconfig.device or DEFAULT_DEVICE)
    comm = comm_time or functools.partial(roofline.comm_time, spec=spec)
    p = pconfig.num_stages
    opt = float(pconfig.optimizer_state_factor)
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

    def static_of(tids: set[int]) -> tuple[int, int, int, int]:
        par = sum(bytes_of[t] for t in tids if trainable[t])
        buf = sum(bytes_of[t] for t in tids if not trainable[t])
        return par, par, int(round(opt * par)), buf

    boundaries = _boundaries(stages)
    costs = {n: _cost(n) for n in stages}
    # the partitioner's own objective, so plan and partitioner can never disagree
    problem = problem_from_graph(gm)
    objective_fn = make_objective(problem, pconfig, comm)
    by_name = {n.name: s for n, s in stages.items()}
    scored = summarize(problem, objective_fn,
                       np.asarray([by_name[x] for x in problem.names], dtype=np.int64), strategy)
    inflight = [pconfig.inflight(s) for s in range(p)]

    stage_plans: list[StagePlan] = []
    for s in range(p):
        nodes = members[s]
        tids = {table[n][0] for n in stage_params[s]}
        par, grad, opt_b, buf = static_of(tids)
        step_s = spec.optimizer_time(sum(1 for t in tids if trainable[t]), par)
        acts = stage_activations(nodes)
        off = acts.region_inputs if pconfig.offload_activations else 0
        saved = acts.saved - off
        mem = MemoryBreakdown(par, grad, opt_b, buf, saved, inflight[s], saved * inflight[s],
                              par + grad + opt_b + buf + saved * inflight[s] + acts.transient,
                              acts.transient, off)
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
            checkpointed=acts.regions, recompute_time_s=_r(recompute_s)))

    objective = max(sp.cost for sp in stage_plans)
    shared = tuple(SharedParam(tuple(names_of[t]), bytes_of[t], tuple(sorted(readers[t])))
                   for t in readers if len(readers[t]) > 1)
    plan = PartitionPlan(
        config=pconfig, device=_to_json(spec.to_json()), stages=tuple(stage_plans),
        objective=_r(objective), lower_bound=_r(scored.lower_bound), strategy=strategy,
        bottleneck_stage=max(range(p), key=lambda i: (stage_plans[i].cost, -i)),
        step_time_s=0.0, bubble_fraction=0.0, shared_params=shared,
        time_total_s=_r(objective_fn.time_total),
        memory_total_bytes=int(round(objective_fn.memory_total)))
    sim = plan.simulate()
    return dataclasses.replace(plan, step_time_s=_r(plan.training_step_s(sim)),
                               pipeline_time_s=_r(sim.step_time_s),
                               bubble_fraction=_r(sim.bubble_fraction))
