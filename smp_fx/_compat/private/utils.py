"""``smdistributed.modelparallel.torch.utils``: ``get_distribution_axis`` (which AWS's
``FP16_Optimizer`` records to merge masters over tp) and ``rmsg``.
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
