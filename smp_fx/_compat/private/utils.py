"""``smdistributed.modelparallel.torch.utils``: what AWS's example helpers import from it.

``get_distribution_axis(param)``: the dimension a tensor-parallel shard is split along
(None for a whole parameter), asked of the process's ``DistributedModel``; AWS's
``FP16_Optimizer`` records it for every fp32 master to merge the masters over tp when
saving. ``rmsg(msg)``: a log message prefixed with this rank's place, as SMP's helpers
print them.
"""

from __future__ import annotations

from typing import Any

import torch

from smp_fx.model import DistributedModel
from smp_fx.world import comm, state
from smp_fx.world.context import current_model


def get_distribution_axis(param: torch.Tensor) -> int | None:
    """The dimension ``param`` is split along over the tp ranks; None if it is whole (also
    before the model is partitioned, or without a DistributedModel)."""
    model = current_model()
    if not isinstance(model, DistributedModel):
        return None
    return model.distribution_axis(param)


def rmsg(msg: Any) -> str:
    """``msg`` prefixed with this process's rank and its pp / tp / rdp ranks."""
    if not state.is_initialized():
        return str(msg)
    return (f"[rank {comm.rank()} pp {comm.pp_rank()} tp {comm.tp_rank()} "
            f"rdp {comm.rdp_rank()}] {msg}")


__all__ = ["get_distribution_axis", "rmsg"]
