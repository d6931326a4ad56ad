"""``PartitionConfig``: everything the partitioner needs to know, and nothing else.

``passes`` cannot import ``smp_fx.config``, so ``smp_fx`` builds this frozen, JSON-able
value; a plan records it and every rank can check it made the same plan. In-flight counts
are read off the schedule (``cost_model.schedule.chunk_peaks``).
``precision``, ``zero`` and ``data_parallel_degree`` say how the model state is held: the
plan counts it with ``cost_model.memory.model_state``, the planner's count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from cost_model import schedule as sched
from cost_model.errors import SMPConfigError
from cost_model.memory import STATE_MODES, ZERO
from cost_model.serial import from_versioned_json, versioned_json

SCHEMA_VERSION = 2
PIPELINES = sched.SCHEDULE_NAMES
ATTENTION_CORE = "attention_core"
"""The strategy of selective recomputation: each attention core under the module is a
region (``passes.attention_core``), the rest of the module is kept."""
STRATEGIES = ("each", "contiguous", ATTENTION_CORE)
"""Checkpointing strategies besides ``group_N`` (N consecutive children per region)."""


@dataclass(frozen=True)
class CheckpointRule:
    """One module whose nodes run under activation checkpointing; ``children`` names a
    ``Sequential``'s children for the grouping strategies (docs/memory.md)."""

    module_path: str
    strategy: str = "each"
    preserve_rng_state: bool = True
    children: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "children", tuple(self.children))
        group = self.strategy.startswith("group_") and self.strategy[6:].isdigit() and int(
            self.strategy[6:]) >= 1
        if self.strategy not in STRATEGIES and not group:
            raise SMPConfigError.build(
                "a checkpointing strategy is 'each', 'contiguous', 'attention_core' or "
                "'group_N' (N >= 1)",
                self.strategy, f"module {self.module_path!r}", "use strategy='each'")

    @property
    def group_size(self) -> int:
        """Children per region: 1 for ``each``, N for ``group_N``, 0 for ``contiguous``."""
        if self.strategy == "contiguous":
            return 0
        return 1 if self.strategy == "each" else int(self.strategy[6:])


@dataclass(frozen=True)
class PartitionConfig:
    """Configuration of one partitioning run; ``device`` names the spec, handed to the passes
    beside it.

    >>> PartitionConfig(num_stages=4, microbatches=8).inflight(3)
    1
    """

    num_stages: int
    memory_weight: float = 0.8
    microbatches: int = 1
    pipeline: str = "interleaved"
    active_microbatches: int | None = None
    auto_partition: bool = True
    default_partition: int = 0
    optimizer_state_factor: float = 2.0
    device: str | None = None
    checkpointing: tuple[CheckpointRule, ...] = ()
    offload_activations: bool = False
    virtual_stages: int = 1
    precision: str = "fp32"
    zero: str = "none"
    data_parallel_degree: int = 1
    persistence_threshold: int = 1_000_000

    def __post_init__(self) -> None:
        rules = tuple(r if isinstance(r, CheckpointRule) else CheckpointRule(**r)
                      for r in self.checkpointing)
        object.__setattr__(self, "checkpointing", rules)
        def bad(name: str, rule: str, fix: str) -> SMPConfigError:
            return SMPConfigError.build(rule, getattr(self, name), f"PartitionConfig.{name}", fix)

        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise bad("num_stages", "num_stages must be an int >= 1", "use 1 or more stages")
        if not 0.0 <= float(self.memory_weight) <= 1.0:
            raise bad("memory_weight", "memory_weight must lie in [0, 1]", "e.g. 0.8 or 0.2")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise bad("microbatches", "microbatches must be an int >= 1", "use 1 or more")
        if self.pipeline not in PIPELINES:
            raise bad("pipeline", f"pipeline must be one of {PIPELINES}", "use 'interleaved'")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise bad("virtual_stages", "virtual_stages (virtual_pipeline_degree) must be an "
                      "int >= 1", "use 1 (one chunk per rank) or more")
        if self.active_microbatches is not None and (
                not isinstance(self.active_microbatches, int) or self.active_microbatches < 1):
            raise bad("active_microbatches", "active_microbatches must be None or an int >= 1",
                      "leave it None for num_stages + 2")
        if not isinstance(self.default_partition, int) or not (
                0 <= self.default_partition < self.num_stages):
            raise bad("default_partition", "default_partition must be in [0, num_stages)",
                      f"use an index below {self.num_stages}")
        if self.optimizer_state_factor < 0:
            raise bad("optimizer_state_factor", "optimizer_state_factor must be >= 0",
                      "2.0 for Adam, 1.0 for momentum SGD, 0.0 for plain SGD")
        if self.precision not in STATE_MODES:
            raise bad("precision", f"precision must be one of {STATE_MODES}",
                      "use 'fp32', 'fp16' or 'bf16_params' (SMP's bf16: true)")
        if self.zero not in ZERO:
            raise bad("zero", f"zero must be one of {ZERO}", "use 'none', 'zero1' or 'fsdp'")
        if not isinstance(self.data_parallel_degree, int) or self.data_parallel_degree < 1:
            raise bad("data_parallel_degree", "data_parallel_degree must be an int >= 1",
                      "the ranks that shard the state (1: no sharding)")
        sched.check_virtual(self.pipeline, self.num_stages, self.microbatches,
                            self.virtual_stages)

    @property
    def active(self) -> int:
        """Microbatches simultaneously in execution (``cost_model.schedule.default_active``
        when unset: SMP's ``num_stages + 2`` where the schedule obeys a cap)."""
        if self.active_microbatches is None:
            return sched.default_active(self.pipeline, self.num_stages, self.microbatches,
                                        self.virtual_stages)
        return self.active_microbatches

    @property
    def num_chunks(self) -> int:
        """Pieces the model is cut into: ``num_stages x virtual_stages``."""
        return self.num_stages * self.virtual_stages

    @property
    def placement(self) -> sched.Placement:
        """The rank of every chunk under this pipeline (round robin; the V for ``zbv``)."""
        return sched.default_placement(self.pipeline, self.num_stages, self.virtual_stages)

    def schedule(self, placement: sched.Placement | None = None) -> sched.Schedule:
        """This configuration's action lists (``placement`` defaults to ``placement``)."""
        return sched.generate(self.pipeline, self.num_stages, self.microbatches, self.active,
                              virtual_stages=self.virtual_stages, placement=placement)

    @functools.cached_property
    def _peaks(self) -> dict[int, int]:
        return sched.chunk_peaks(self.schedule())

    def inflight(self, stage: int, placement: sched.Placement | None = None) -> int:
        """Microbatches whose saved activations chunk ``stage`` holds at its peak (under
        ``placement``, default ``placement``)."""
        if placement is not None and tuple(placement) != self.placement:
            return sched.chunk_peaks(self.schedule(placement)).get(stage, 0)
        return self._peaks.get(stage, 0)

    def to_json(self) -> dict[str, Any]:
        """The versioned fields; the memory features are left out while off, so a plan
        that uses none of them reads as it always did (and golden files stay put)."""
        out = versioned_json(self, SCHEMA_VERSION)
        for name in ("checkpointing", "offload_activations"):
            if not out[name]:
                del out[name]
        for name in ("virtual_stages", "precision", "zero", "data_parallel_degree",
                     "persistence_threshold"):
            if out[name] == PartitionConfig.__dataclass_fields__[name].default:
                del out[name]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartitionConfig:
        return from_versioned_json(cls, data, SCHEMA_VERSION)
