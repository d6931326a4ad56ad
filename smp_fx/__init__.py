"""smp-fx: the SageMaker model parallel library (SMP v1) API on torch.fx.

Use it as SMP is used::

    import smp_fx as smp
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})

Every public name is imported here; nothing else in the package is public.
"""

from __future__ import annotations

from cost_model.errors import (
    SMPCheckpointError,
    SMPConfigError,
    SMPError,
    SMPNotImplementedError,
    SMPPartitionError,
    SMPRuntimeError,
    SMPTimeoutError,
    SMPTracingError,
)

__version__ = "0.1.0"

# --- foundation: init, config, ranks, groups, comm (section owned by the foundation work) ---

# --- manual partitioning and delayed initialization ---

# --- runtime: DistributedModel, DistributedOptimizer, step, StepOutput ---

# --- checkpointing ---
