"""SMP's DeepSpeed-style view of sharded data parallelism (``ds_tensor``, ``ds_shape``,
``fp32_partitioned_groups_flat`` ...), which AWS's ``sdp_utils.py`` reads.

A partition here is FSDP2's chunk of dim 0, not DeepSpeed's split of the flat tensor, so
sizes differ but norms summed over the shard group agree. See docs/clients.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from cost_model.errors import SMPConfigError
from smp_fx.parallel.dtensor_check import is_dtensor
from smp_fx.world import state

SOURCE = "_smp_fx_ds_source"
"""A parameter's attribute naming the tensor that holds its current value (the sharded
parameter of an original, the fp32 master of a half one)."""


def coords(st: state.State) -> tuple[int, int]:
    """This rank's index in its shard group, and the group's size."""
    sdp = st.config.sharded_data_parallel_degree
    return st.group_ranks("dp").index(st.rank) % sdp, sdp


def partition(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The flat partition of ``t`` on shard ``rank`` of ``size`` (module docstring): a view."""
    with torch.no_grad():
        if is_dtensor(t):
            return t.to_local().detach().view(-1)
        whole = t.detach().reshape(1) if t.dim() == 0 else t.detach()
        rows = -(-whole.shape[0] // size)
        start = min(rank * rows, whole.shape[0])
        return whole[start:min(start + rows, whole.shape[0])].reshape(-1)


def attach(param: torch.Tensor, part: torch.Tensor, shape: Sequence[int]) -> None:
    """Give ``param`` DeepSpeed's attributes: ``part`` its partition, ``shape`` its whole."""
    part.ds_numel = part.numel()  # type: ignore[attr-defined]
    param.ds_tensor = part  # type: ignore[attr-defined]
    param.ds_shape = torch.Size(shape)  # type: ignore[attr-defined]
    param.ds_numel = math.prod(shape)  # type: ignore[attr-defined]


def attach_whole(params: Iterable[torch.Tensor], rank: int, size: int) -> None:
    """Before partitioning (every rank holds whole parameters): the partition each will
    hold, so scripts can size their buffers at once, as under DeepSpeed's ``zero.Init``."""
    for p in params:
        attach(p, partition(p, rank, size), p.shape)


def attach_partitioned(originals: Iterable[tuple[str, torch.Tensor]],
                       local: Iterable[tuple[str, torch.Tensor]], rank: int, size: int
                       ) -> None:
    """After partitioning: each local (sharded) parameter gets its partition, and the
    original object of the same name (what ``model.named_parameters()`` still yields and a
    script's dictionaries are keyed by) reads the same views."""
    by_name = dict(originals)
    for name, p in local:
        shape = p.shape
        attach(p, partition(p, rank, size), shape)
        orig = by_name.get(name)
        if orig is not None and orig is not p:
            attach(orig, p.ds_tensor, shape)  # type: ignore[attr-defined]
            setattr(orig, SOURCE, p)


def attach_masters(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], rank: int,
                   size: int) -> None:
    """fp16 / bf16: each (parameter, fp32 master) pair; the master is the fp32 value."""
    for p, master in pairs:
        attach(master, partition(master, rank, size), master.shape)
        setattr(p, SOURCE, master)


def fp32_partition(param: torch.Tensor) -> torch.Tensor:
    """The current fp32 partition of ``param`` (of its master in half training)."""
    while hasattr(param, SOURCE):
        param = getattr(param, SOURCE)
    part: torch.Tensor = param.ds_tensor  # type: ignore[attr-defined]
    return part if part.dtype == torch.float32 else part.float()


class LivePartition(torch.Tensor):
    """A parameter's fp32 partition as ``fp32_partitioned_groups_flat[i].narrow`` gives it.
    Scripts keep it across steps (DeepSpeed's is a view of the masters the optimizer
    updates in place), so every torch operation on it reads the partition at that moment."""

    param: torch.Tensor

    @staticmethod
    def __new__(cls, param: torch.Tensor) -> LivePartition:
        out = torch.Tensor._make_subclass(cls, fp32_partition(param), False)
        out.param = param
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        args, kwargs = pytree.tree_map_only(
            LivePartition, lambda t: fp32_partition(t.param), (args, kwargs or {}))
        return func(*args, **kwargs)


@dataclass(frozen=True)
class FlatGroup:
    """One param group's partitions end to end, in the group's order (DeepSpeed's flat
    fp32 group): ``narrow(0, offset, ds_numel)`` at one parameter's place gives that
    parameter's ``LivePartition``; ``tensor()`` the whole group now (a copy)."""

    params: tuple[torch.Tensor, ...]

    def numel(self) -> int:
        return sum(p.ds_tensor.ds_numel for p in self.params)  # type: ignore[attr-defined]

    def tensor(self) -> torch.Tensor:
        return torch.cat([fp32_partition(p) for p in self.params])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        offset = 0
        for p in self.params:
            n = p.ds_tensor.ds_numel  # type: ignore[attr-defined]
            if dim == 0 and (start, length) == (offset, n):
                return LivePartition(p)
            offset += n
        raise SMPConfigError.build(
            "fp32_partitioned_groups_flat[i].narrow takes one parameter's partition "
            "(offset = the sum of the earlier parameters' ds_tensor.ds_numel)",
            (dim, start, length), "fp32_partitioned_groups_flat",
            "narrow at a parameter's (offset, ds_tensor.ds_numel), or read .tensor()")


def flat_groups(param_groups: Sequence[dict[str, Any]]) -> list[FlatGroup]:
    """``fp32_partitioned_groups_flat`` of an optimizer with these param groups."""
    for group in param_groups:
        for p in group["params"]:
            if not hasattr(p, "ds_tensor"):
                raise AttributeError(
                    "fp32_partitioned_groups_flat exists under sharded data parallelism "
                    "('sharded_data_parallel_degree' > 1), for the parameters of a "
                    "smp.DistributedModel")
    return [FlatGroup(tuple(g["params"])) for g in param_groups]


def model_groups(param_groups: Sequence[dict[str, Any]],
                 originals: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``fp16_groups``: the param groups' tensors as the model's own parameters (what
    ``model.named_parameters()`` yields), through the sharded parameters and masters that
    stand for them."""
    model_of: dict[int, torch.Tensor] = {}
    for orig in originals:
        t: Any = orig
        while t is not None:
            model_of.setdefault(id(t), orig)
            t = getattr(t, SOURCE, None)
    return [[model_of.get(id(p), p) for p in g["params"]] for g in param_groups]


def shard_group(st: state.State, mesh: Any) -> Any:
    """The shard group's process group (``ds_param_shard_group``): the mesh's last axis
    once partitioned, else the dp group when it is the shard group."""
    if mesh is not None:
        return mesh.get_group(mesh.ndim - 1)
    if len(st.group_ranks("dp")) == st.config.sharded_data_parallel_degree:
        return st.group("dp")
    raise SMPConfigError.build(
        "ds_param_shard_group with shard groups smaller than the dp group exists once the "
        "model is partitioned", st.config.sharded_data_parallel_degree,
        "DistributedOptimizer.ds_param_shard_group", "read it after the first smp.step")


__all__ = ["FlatGroup", "LivePartition", "attach", "attach_masters", "attach_partitioned",
           "attach_whole", "coords", "flat_groups", "fp32_partition", "model_groups", "partition",
           "shard_group"]
