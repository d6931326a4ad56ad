"""One planning request: everything the compiler is asked for a plan, built in one place.

Why one builder: ``smp-fx partition`` promises the plan ``DistributedModel`` makes at its
first step (same configuration, model, first microbatch and device spec). Both ask the
compiler through ``plan_request``, so the translation from the SMP configuration and the
model's marks (pins from ``smp.partition``, checkpointed modules, tensor-parallel
modules) cannot drift between them; what differs between the two callers is a parameter
(this rank's tensor-parallel rank; the CLI's checkpointing patterns and optimizer state
factor).

Example::

    request = plan_request(load_config({"partitions": 2}, env={}), model, A100, tp_rank=0)
    compiled = request.compile(model, (x,), {})
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

    def compile(self, model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
                *, frontend: Frontend = "auto", progress: Progress | None = None,
                measured: Mapping[str, Sequence[float | None]] | None = None,
                traced: torch.fx.GraphModule | None = None) -> Compiled:
        """``passes.pipeline.compile_model`` of ``model`` on one microbatch, as requested."""
        return compile_model(model, args, kwargs, self.config, device=self.device,
                             frontend=frontend, pins=None if self.pins is None
                             else dict(self.pins), measured=measured, progress=progress,
                             traced=traced, tp=self.tp, allow_real_run=self.real_run)


def plan_request(cfg: SMPConfig, module: nn.Module, device: DeviceSpec, tp_rank: int, *,
                 checkpointing: tuple[CheckpointRule, ...] | None = None,
                 optimizer_state_factor: float = 2.0,
                 data_parallel_degree: int = 1) -> PlanRequest:
    """The request for ``module`` under ``cfg``, priced with ``device`` (before
    ``for_stages``), for tensor-parallel rank ``tp_rank``.

    ``checkpointing`` replaces the modules ``module`` marks for activation checkpointing
    (``smp-fx partition --activation-checkpointing`` patterns); ``optimizer_state_factor``
    is optimizer state bytes per parameter byte (Adam: 2), ``data_parallel_degree`` the
    rdp ranks ``shard_optimizer_state`` divides it over. Build it after ``module`` was
    traced: ``smp.checkpoint`` called in a forward marks its module only then."""
    spec = device.for_stages(cfg.pipeline_parallel_degree)
    rules = checkpoint_rules(module) if checkpointing is None else checkpointing
    pins = None if cfg.auto_partition else tuple(pins_by_module_path(module).items())
    tp = (rewrite_inputs(cfg, tp_rank, module) if cfg.tensor_parallel_degree > 1 else None)
    return PlanRequest(cfg.partition_config(spec.name, optimizer_state_factor, rules,
                                            data_parallel_degree), spec,
                       pins, tp, real_run=not cfg.skip_tracing)
