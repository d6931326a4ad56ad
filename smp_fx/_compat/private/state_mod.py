"""``smdistributed.modelparallel.torch.state_mod``: SMP's process state as ``state``.

Adds the per-tp-rank maps between optimizer parameter indices and names that AWS's fp16
helpers read; they are gathered over the tp group when read, a collective on every tp rank.
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
