"""One planning request: everything the compiler is asked for a plan, built in one place.

``smp-fx partition`` promises the plan ``DistributedModel`` makes at its first step; both
ask through ``plan_request``, so the translation from the configuration and the marks
cannot drift between them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx
from torch import nn

from cost_model.device import DeviceSpec
from passes.partition_config import CheckpointRule, PartitionConfig
from passes.pipeline import Compiled, Progress, compile_model
from passes.tensor_parallel import TensorParallelism
from passes.trace import Frontend
from smp_fx.config import SMPConfig
from smp_fx.marking.activation_checkpointing import checkpoint_rules
from smp_fx.marking.manual import pins_by_module_path
from smp_fx.marking.tensor_parallelism import rewrite_inputs


@dataclass(frozen=True)
class PlanRequest:
    """The compiler's inputs for one plan, less the model and its microbatch."""

    config: PartitionConfig
    """The SMP configuration as the partitioner needs it, with the checkpoint rules."""
    device: DeviceSpec
    """The spec the plan is priced with, ``pipelined_scale`` folded in (``for_stages``)."""
    pins: tuple[tuple[str, int], ...] | None
    """``smp.partition`` pins by module path (manual partitioning), None when automatic."""
    tp: TensorParallelism | None
    """This rank's tensor-parallel rewrite, None at degree 1."""
    real_run: bool = True
    """Whether planning may run the model on real tensors (SMP's tracing step); False under
    ``skip_tracing``: shapes come from fake tensors only, or the plan fails naming why."""
    cp: int = 1
    """The context-parallel degree: the sequence split over this many ranks."""
    cp_local_outputs: bool = False
    """The model's outputs stay each cp rank's tokens (``context_parallel_local_outputs``)."""

    def compile(self, model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
                *, frontend: Frontend = "auto", progress: Progress | None = None,
                measured: Mapping[str, Sequence[float | None]] | None = None,
                traced: torch.fx.GraphModule | None = None) -> Compiled:
        """``passes.pipeline.compile_model`` of ``model`` on one microbatch, as requested."""
        return compile_model(model, args, kwargs, self.config, device=self.device,
                             frontend=frontend, pins=None if self.pins is None
                             else dict(self.pins), measured=measured, progress=progress,
                             traced=traced, tp=self.tp, allow_real_run=self.real_run,
                             cp=self.cp, cp_local_outputs=self.cp_local_outputs)


def plan_request(cfg: SMPConfig, module: nn.Module, device: DeviceSpec, tp_rank: int, *,
                 checkpointing: tuple[CheckpointRule, ...] | None = None,
                 optimizer_state_factor: float = 2.0,
                 data_parallel_degree: int = 1) -> PlanRequest:
    """The request for ``module`` under ``cfg``, priced with ``device``, for tp rank
    ``tp_rank``, the state sharded over ``data_parallel_degree`` rdp ranks where the
    configuration shards it; build it after tracing (``smp.checkpoint`` marks in a forward)."""
    spec = device.for_stages(cfg.pipeline_parallel_degree)
    rules = checkpoint_rules(module) if checkpointing is None else checkpointing
    pins = None if cfg.auto_partition else tuple(pins_by_module_path(module).items())
    tp = (rewrite_inputs(cfg, tp_rank, module) if cfg.tensor_parallel_degree > 1 else None)
    return PlanRequest(cfg.partition_config(spec.name, optimizer_state_factor, rules,
                                            data_parallel_degree), spec,
                       pins, tp, real_run=not cfg.skip_tracing,
                       cp=cfg.context_parallel_degree,
                       cp_local_outputs=cfg.context_parallel_local_outputs)
