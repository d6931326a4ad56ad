"""Checkpoints of a model under sharded data parallelism (FSDP2): shards as whole tensors,
so a file is the same as without sharding and loads at any degree; the gathered copy
costs one stage's full state during the save. See docs/checkpoints.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from smp_fx.parallel.dtensor_check import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def whole(value: Any) -> Any:
    """``value`` (a state dict, nested) with every ``DTensor`` gathered to a plain tensor."""
    if is_dtensor(value):
        return value.full_tensor()
    if isinstance(value, dict):
        return type(value)((k, whole(v)) for k, v in value.items())
    if isinstance(value, list):
        return [whole(v) for v in value]
    return value


def shard_like(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (whole) as a tensor like ``target``: this rank's shard when ``target`` is a
    ``DTensor``, else ``value`` itself."""
    if is_dtensor(target) and not is_dtensor(value):
        from torch.distributed.tensor import distribute_tensor  # loaded: target is one

        return distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements,
                                 src_data_rank=None)
    return value


def assign(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a whole ``value`` into ``target`` (a parameter, perhaps a shard)."""
    if is_dtensor(target):
        target.to_local().copy_(cast("DTensor", shard_like(target, value)).to_local())
    else:
        target.copy_(value)


def reshard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict`` of whole tensors: each state tensor of a sharded
    parameter with the parameter's shape becomes the matching shard (step counters and
    other scalars stay as loaded)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not is_dtensor(p):
                continue
            entry = optimizer.state.get(p, {})
            for key, value in list(entry.items()):
                if isinstance(value, torch.Tensor) and not is_dtensor(value) \
                        and tuple(value.shape) == tuple(p.shape):
                    entry[key] = shard_like(p, value)


__all__ = ["assign", "reshard_optimizer_state", "shard_like", "whole"]
