"""``smdistributed.modelparallel.torch.state_mod``: SMP's process state as ``state``.

AWS's fp16 helpers (``from smdistributed.modelparallel.torch.state_mod import state as
smp_state``) read, besides what ``smp.state`` has (``cfg``, ``module_manager``), the
tensor-parallel maps between the optimizer's parameter indices and the parameters' names,
one map per tp rank: ``param_index_to_name_tp_group[tp_rank][index]`` and
``param_name_to_index_tp_group[tp_rank][name]``. The index is the one
``DistributedOptimizer._param_id_to_index()`` gives (the parameter's place in the
optimizer's original flat order), the name the parameter's in the wrapped module. They
are gathered over the tp group when read: a collective, on every tp rank, as the helpers
read them (at checkpoint save and load).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from cost_model.errors import SMPRuntimeError
from smp_fx.optimizer import DistributedOptimizer
from smp_fx.world import comm
from smp_fx.world import state as _state
from smp_fx.world.context import current_optimizer


def _local_index_to_name() -> dict[int, str]:
    opt = current_optimizer()
    if not isinstance(opt, DistributedOptimizer):
        raise SMPRuntimeError.build(
            "the optimizer's parameter maps need a DistributedOptimizer", type(opt).__name__,
            "smp_state.param_index_to_name_tp_group", "create smp.DistributedOptimizer first")
    names = opt._smp_flat_names()
    return {i: str(names[i]) for i in sorted(set(opt._param_id_to_index().values()))}


def _gathered() -> list[dict[int, str]]:
    local = _local_index_to_name()
    if comm.tp_size() == 1:
        return [local]
    out: list[Any] = [None] * comm.tp_size()
    dist.all_gather_object(out, local, group=comm.get_tp_process_group())
    return out


class _State:
    """``smp.state`` (``smp_fx.world.state``) with SMP's tensor-parallel parameter maps."""

    @property
    def param_index_to_name_tp_group(self) -> list[dict[int, str]]:
        return _gathered()

    @property
    def param_name_to_index_tp_group(self) -> list[dict[str, int]]:
        return [{n: i for i, n in m.items()} for m in _gathered()]

    def __getattr__(self, name: str) -> Any:
        return getattr(_state, name)


state = _State()

__all__ = ["state"]
