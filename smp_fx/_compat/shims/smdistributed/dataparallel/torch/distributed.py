"""The deprecated ``smdistributed.dataparallel.torch.distributed`` API, mapped onto
``torch.distributed`` with the signatures of the smddp guide (SMP's documentation,
``smddp_pytorch_guide.rst``):
``broadcast``'s ``src`` defaults to 0 and ``all_to_all_single`` takes ``output_t`` /
``input_t``, where torch's own names and defaults differ. ``group=None`` is torch's spelling
of the guide's ``group.WORLD`` default. ``init_process_group`` defaults to the ``smddp``
backend, as the library did."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as _dist
from torch.distributed import (
    ReduceOp,
    all_gather,
    all_reduce,
    barrier,
    get_rank,
    get_world_size,
    group,
    is_available,
    is_initialized,
)

from smp_fx.world.smddp import NAME, register

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


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None,
              async_op: bool = False) -> Any:
    """``torch.distributed.broadcast`` from rank ``src`` (0 unless given, as in smddp)."""
    return _dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_to_all_single(output_t: torch.Tensor, input_t: torch.Tensor,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None,
                      async_op: bool = False) -> Any:
    """``torch.distributed.all_to_all_single`` under smddp's argument names."""
    return _dist.all_to_all_single(output_t, input_t, output_split_sizes=output_split_sizes,
                                   input_split_sizes=input_split_sizes, group=group,
                                   async_op=async_op)
