"""The ``PartitionPlan`` value: its dataclasses and their JSON form (``passes.plan`` builds it).

The JSON is deterministic so golden files compare exactly; ``OPTIONAL`` fields are left
out at their default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from cost_model import roofline
from cost_model.device import DeviceSpec
from cost_model.errors import SMPPartitionError
from cost_model.simulate import SimResult, StageCost, simulate, training_step_s
from passes.partition_config import PartitionConfig

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
    """Bytes one stage needs at its peak (docs/memory.md, 'The memory model')."""

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
    pending_w_per_microbatch: int = field(default=0, metadata=OPTIONAL)
    """With a split backward: what a microbatch keeps from its I until its W
    (``passes.weight_grads``): its activations (offloaded ones back for the I), the
    gradients recorded at the joins and the checkpointed regions rebuilt."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage, times per microbatch; ``time_s = max(fwd + bwd, link_time_s)``
    (docs/architecture.md, 'Stage time model')."""

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
    wgrad_time_s: float = field(default=0.0, metadata=OPTIONAL)
    """With a split backward: the weight-gradient part (W) of ``bwd_time_s``."""

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
class RankPlan:
    """A pipeline rank holding several chunks or running a split backward: its chunks and its
    memory at the schedule's peak."""

    index: int
    chunks: tuple[int, ...]
    static: int
    activations: int
    total: int


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
    placement: tuple[int, ...] = field(default=(), metadata=OPTIONAL)
    """The rank of every chunk (``stages`` are chunks, in model order); empty: chunk s on
    rank s (one chunk per rank)."""
    ranks: tuple[RankPlan, ...] = field(default=(), metadata=OPTIONAL)
    bubble_rate: float = field(default=0.0, metadata=OPTIONAL)
    """The papers' bubble over the ideal step (``SimResult.bubble_rate``), when ``ranks``."""

    @property
    def rank_of(self) -> tuple[int, ...]:
        """The rank of every chunk."""
        return self.placement or tuple(range(len(self.stages)))

    @property
    def num_ranks(self) -> int:
        return 1 + max(self.rank_of, default=-1)

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
        """The simulator's view of the stages, the same numbers the plan's step time used."""
        spec = self.spec()
        latency = max((st.comm_time_s - st.link_time_s for st in self.stages
                       if st.out_bytes > 0), default=0.0)
        out = []
        for s, st in enumerate(self.stages):
            back = self.stages[s - 1].link_time_s if s > 0 else 0.0
            static = st.memory.total - st.memory.activations
            pending = st.memory.pending_w_per_microbatch
            out.append(StageCost(st.fwd_time_s, st.bwd_time_s, st.link_time_s, back, static,
                                 st.memory.activations_per_microbatch, max(latency, 0.0),
                                 spec.microbatch_overhead_s, spec.message_overhead_s,
                                 st.wgrad_time_s, pending if st.wgrad_time_s > 0 else None))
        return tuple(out)

    def simulate(self) -> SimResult:
        """Re-run the simulator on this plan's chunks, placement and schedule."""
        return simulate(self.config.schedule(self.rank_of), self.stage_costs())

    def training_step_s(self, sim: SimResult) -> float:
        """The training step of ``sim`` (``cost_model.simulate.training_step_s``): the
        replicated gradients' all-reduce over the ranks holding them, each rank's
        optimizer (its chunks' in turn), the fixed step cost."""
        spec = self.spec()
        rank_of = self.rank_of
        sums = []
        for sh in self.shared_params:
            ranks = tuple(sorted({rank_of[s] for s in sh.stages}))
            if len(ranks) > 1:  # tied chunks on one rank sum their gradients in place
                sums.append((ranks, 2.0 * (roofline.comm_time(sh.nbytes, spec)
                                           + spec.message_overhead_s)))
        after = [0.0] * self.num_ranks
        for s, st in enumerate(self.stages):
            after[rank_of[s]] += st.optimizer_time_s
        return training_step_s(sim, after, sums, spec.step_overhead_s)

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
        d["placement"] = tuple(d.get("placement", ()))
        d["ranks"] = tuple(RankPlan(r["index"], tuple(r["chunks"]), r["static"],
                                    r["activations"], r["total"]) for r in d.get("ranks", ()))
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
