"""smp-fx: the SageMaker model parallel library (SMP v1) API on torch.fx.

Use it as SMP is used::

    import smp_fx as smp
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})

Every public name is listed here, in the ``if TYPE_CHECKING:`` block that type checkers
read; nothing else in the package is public. A name's module is imported when the name is
first used, so ``import smp_fx`` (and ``smp-fx run``'s launcher) costs no torch import.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

from smp_fx import namespaces as _namespaces

__version__ = "0.1.0"

if TYPE_CHECKING:
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

    # --- foundation: init, config, ranks, groups, comm (section owned by the foundation work) ---
    from smp_fx.world.comm import (
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
    from smp_fx.config import SMPConfig
    from smp_fx.world.expert_groups import (
        ep_rank,
        ep_size,
        get_ep_group,
        get_ep_process_group,
    )
    from smp_fx.world.init import init, is_initialized
    from smp_fx.topology import Topology
    from smp_fx.world import state  # smp.state, as SMP scripts reach it

    # --- manual partitioning and delayed initialization ---
    from smp_fx.marking.delayed_init import delay_param_initialization
    from smp_fx.marking.manual import partition, set_partition

    # --- runtime: DistributedModel, DistributedOptimizer, step, StepOutput ---
    from smp_fx.model import DistributedModel
    from smp_fx.world.context import is_tracing
    from smp_fx.optimizer import DistributedOptimizer
    from smp_fx.step import StepOutput, step
    from smp_fx.grad_average import hvd_average_grads

    # --- checkpointing ---
    from smp_fx.ckpt.files import load, save

    # --- memory: activation checkpointing (offloading is the offload_activations parameter) ---
    from smp_fx.marking.activation_checkpointing import (
        checkpoint,
        checkpoint_sequential,
        set_activation_checkpointing,
    )

    # --- SMP v1 surface real clients use (checkpoint folders, reset, submodule namespaces) ---
    from smp_fx.ckpt.checkpoint_api import resume_from_checkpoint, save_checkpoint
    from smp_fx.ckpt.async_save import wait_checkpoint
    from smp_fx.runtime.executor.stragglers import straggler_report
    from smp_fx.measured import write_measurement
    from smp_fx.reset import reset
    from smp_fx import amp, nn, optimizers

    # --- tensor parallelism: which modules are distributed ---
    from smp_fx.marking.tensor_parallelism import set_tensor_parallelism, tensor_parallelism
    from smp_fx.marking.tp_register import tp_register, tp_register_with_module
    from smp_fx.marking.model_creation import model_creation

    # --- context parallelism: a step function reading each rank's tokens of the outputs ---
    from smp_fx.cp_outputs import cp_mean, cp_positions


def _public_names() -> dict[str, tuple[str, str]]:
    """Public name -> (module, attribute), read from the ``if TYPE_CHECKING:`` block above:
    the one list of the public API, for type checkers and for ``__getattr__`` alike."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If)
                 and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING")
    return {alias.asname or alias.name: (node.module or "", alias.name)
            for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}


_PUBLIC = _public_names()
__all__ = sorted(_PUBLIC)


def _load(module: str, attr: str) -> object:
    """``from module import attr``, where attr may be a submodule not imported yet."""
    if module != __name__:
        found = getattr(importlib.import_module(module), attr, _load)
        if found is not _load:
            return found
    return importlib.import_module(f"{module}.{attr}")


def __getattr__(name: str) -> object:
    """A public name, imported on first use (then kept here); any other submodule as an
    attribute, as a package offers it once imported; SMP names not built yet raise
    ``SMPNotImplementedError`` (``smp_fx.namespaces``)."""
    if name in _PUBLIC:
        value = _load(*_PUBLIC[name])
        globals()[name] = value
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        return importlib.import_module(f"{__name__}.{name}")
    _namespaces.planned("smp", name, _namespaces.PLANNED)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


class _Package(types.ModuleType):
    """``smp_fx`` itself. Importing a submodule binds it on its package, which must not hide
    the public name of the same spelling (``smp.step`` is the function of ``smp_fx.step``)."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and _PUBLIC.get(name, ("",))[0] == value.__name__:
            value = getattr(value, _PUBLIC[name][1])
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
