"""smp-fx: the SageMaker model parallel library (SMP v1) API on torch.fx.

Use it as SMP is used::

    import smp_fx as smp
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})

Every public name is imported here; nothing else in the package is public.
"""

from __future__ import annotations

from cost_model.errors import (
    ScheduleError,
    SMPCheckpointError,
    SMPConfigError,
    SMPError,
    SMPInternalError,
    SMPNotImplementedError,
    SMPOrderError,
    SMPPartitionError,
    SMPPassError,
    SMPPeerError,
    SMPRuntimeError,
    SMPTimeoutError,
    SMPTracingError,
)

__version__ = "0.1.0"

# --- foundation: init, config, ranks, groups, comm (section owned by the foundation work) ---
from smp_fx.world.comm import (  # noqa: E402
    DP_GROUP,
    DP_RANK,
    MP_GROUP,
    MP_RANK,
    PP_GROUP,
    PP_RANK,
    RDP_GROUP,
    RDP_RANK,
    TP_GROUP,
    TP_RANK,
    WORLD,
    WORLD_RANK,
    CommGroup,
    RankType,
    allgather,
    barrier,
    broadcast,
    cp_rank,
    cp_size,
    dp_barrier,
    dp_rank,
    dp_size,
    get_cp_group,
    get_cp_process_group,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    get_world_process_group,
    local_rank,
    local_size,
    mp_barrier,
    mp_rank,
    mp_size,
    num_microbatches,
    pp_rank,
    pp_size,
    rank,
    rdp_rank,
    rdp_size,
    recv_from,
    send,
    size,
    tp_rank,
    tp_size,
)
from smp_fx.config import SMPConfig  # noqa: E402
from smp_fx.world.expert_groups import (  # noqa: E402
    ep_rank,
    ep_size,
    get_ep_group,
    get_ep_process_group,
)
from smp_fx.world.init import init, is_initialized  # noqa: E402
from smp_fx.topology import Topology  # noqa: E402
from smp_fx.world import state  # noqa: E402  (smp.state, as SMP scripts reach it)


# --- manual partitioning and delayed initialization ---
from smp_fx.marking.delayed_init import delay_param_initialization  # noqa: E402,F401
from smp_fx.marking.manual import partition, set_partition  # noqa: E402

# --- runtime: DistributedModel, DistributedOptimizer, step, StepOutput ---
from smp_fx.model import DistributedModel  # noqa: E402
from smp_fx.world.context import is_tracing  # noqa: E402
from smp_fx.optimizer import DistributedOptimizer  # noqa: E402
from smp_fx.step import StepOutput, step  # noqa: E402
from smp_fx.grad_average import hvd_average_grads  # noqa: E402

# --- checkpointing ---
from smp_fx.ckpt.files import load, save  # noqa: E402

# --- memory: activation checkpointing (offloading is the offload_activations parameter) ---
from smp_fx.marking.activation_checkpointing import (  # noqa: E402
    checkpoint,
    checkpoint_sequential,
    set_activation_checkpointing,
)

# --- SMP v1 surface real clients use (checkpoint folders, reset, submodule namespaces) ---
from smp_fx.ckpt.checkpoint_api import resume_from_checkpoint, save_checkpoint  # noqa: E402
from smp_fx.ckpt.async_save import wait_checkpoint  # noqa: E402
from smp_fx.runtime.executor.stragglers import straggler_report  # noqa: E402
from smp_fx.measured import write_measurement  # noqa: E402
from smp_fx.reset import reset  # noqa: E402
from smp_fx import amp, nn, optimizers  # noqa: E402

# --- tensor parallelism: which modules are distributed ---
from smp_fx.marking.tensor_parallelism import set_tensor_parallelism, tensor_parallelism  # noqa: E402
from smp_fx.marking.tp_register import tp_register, tp_register_with_module  # noqa: E402
from smp_fx.marking.model_creation import model_creation  # noqa: E402

# --- context parallelism: a step function reading each rank's tokens of the outputs ---
from smp_fx.cp_outputs import cp_mean, cp_positions  # noqa: E402
from smp_fx import namespaces as _namespaces  # noqa: E402


def __getattr__(name: str) -> object:
    """SMP names not built yet raise ``SMPNotImplementedError`` (``smp_fx.namespaces``)."""
    _namespaces.planned("smp", name, _namespaces.PLANNED)
