"""The ``smp.DistributedModel`` arguments and their checks, a value apart from the model so
a wrong argument fails at wrapping, never at the first step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cost_model.errors import SMPConfigError
from smp_fx.marking.delayed_init import is_delayed
from smp_fx.world import state


@dataclass(frozen=True)
class ModelOptions:
    """The ``DistributedModel`` arguments (DDP ones are kept for the data-parallel work)."""

    trace_device: str = "gpu"
    trace_execution_times: bool = False
    overlapping_allreduce: bool = True
    backward_passes_per_step: int = 1
    average_grads_across_microbatches: bool = True
    bucket_cap_mb: int = 25
    trace_memory_usage: bool = False
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = False

    def check(self, module: nn.Module) -> None:
        """Raise ``SMPConfigError`` for arguments (or a module) smp-fx cannot run with."""
        if self.trace_device not in ("cpu", "gpu"):
            raise SMPConfigError.build("trace_device must be 'cpu' or 'gpu'",
                                       self.trace_device, "smp.DistributedModel",
                                       "pass 'cpu' or 'gpu'")
        if self.trace_execution_times and self.trace_device == "cpu":
            raise SMPConfigError.build(
                "trace_execution_times must be False if trace_device is 'cpu'", True,
                "smp.DistributedModel", "set trace_device='gpu' or trace_execution_times=False")
        # a configured feature DistributedModel would use but smp-fx lacks (fp16, tensor
        # parallelism, ...) is an error here, never silently ignored
        if state.is_initialized():
            state.get().config.check_features("DistributedModel")
        if (self.trace_execution_times or self.trace_memory_usage) and is_delayed(module):
            raise SMPConfigError.build(
                "trace_execution_times / trace_memory_usage run the model, which a model "
                "built under smp.delay_param_initialization() cannot do", True,
                "smp.DistributedModel", "leave both False (analytic costs need no weights)")
        if (self.trace_execution_times or self.trace_memory_usage) and state.is_initialized() \
                and state.get().config.skip_tracing:
            raise SMPConfigError.build(
                "trace_execution_times / trace_memory_usage measure the tracing step, which "
                "'skip_tracing': true skips", True, "smp.DistributedModel",
                "leave both False, or drop 'skip_tracing'")
        if isinstance(module, torch.jit.ScriptModule):
            raise SMPConfigError.build("torch.jit.ScriptModules are not supported",
                                       type(module).__name__, "smp.DistributedModel",
                                       "wrap the plain nn.Module")
