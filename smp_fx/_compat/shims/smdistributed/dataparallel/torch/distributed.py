"""The deprecated ``smdistributed.dataparallel.torch.distributed`` API, mapped onto
``torch.distributed`` (the smddp guide lists these names). ``init_process_group`` defaults
to the ``smddp`` backend, as the library did."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as _dist
from torch.distributed import (
    ReduceOp,
    all_gather,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    group,
    is_available,
    is_initialized,
)

from smp_fx.dist.smddp import NAME, register

__all__ = ["ReduceOp", "all_gather", "all_reduce", "all_to_all_single", "barrier",
           "broadcast", "get_local_rank", "get_rank", "get_world_size", "group",
           "init_process_group", "is_available", "is_initialized"]


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` with ``backend="smddp"`` unless given."""
    register()
    if not args and "backend" not in kwargs:
        kwargs["backend"] = NAME
    _dist.init_process_group(*args, **kwargs)


def get_local_rank() -> int:
    """Rank of this process on its node (``LOCAL_RANK``, set by torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))
