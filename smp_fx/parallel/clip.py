"""Global gradient norms and clipping over a partitioned model: the unpartitioned model's norm.

A stage sees only its part of the model, so each rank sums the gradients it counts and
the sums are all-reduced over pp x tp: every rank scales by the whole model's factor.
Tied replicas and tp copies count once; expert slices (``expert_parallel_degree`` > 1)
are summed over the ep group. See docs/precision.md, 'Global gradient clipping'.

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 3.0)
>>> float(clip_grads(NormScope(), [p.grad], [p.grad], max_norm=3.0))  # norm 6 -> halved
6.0
>>> [round(g, 5) for g in p.grad.tolist()]  # times 3 / (6 + 1e-6), as torch's
[1.5, 1.5, 1.5, 1.5]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from cost_model.errors import SMPRuntimeError
from smp_fx.parallel.dtensor_check import is_dtensor
from smp_fx.world import context, expert_groups, state


@dataclass(frozen=True)
class NormScope:
    """Where a norm is summed: this rank's tp index (tp rank 0 counts replicated
    parameters), the device of an empty sum, and the model-parallel groups to reduce over.
    ``NormScope()``: one process, before or without ``smp.init``."""

    tp_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: tuple[Any, ...] = ()

    @classmethod
    def of(cls, st: state.State | None) -> NormScope:
        """This rank's scope under ``st`` (None: not initialised); the model-parallel group
        only when it spans several processes."""
        if st is None:
            return cls()
        alone = st.in_process or st.world_size == 1 or len(st.group_ranks("mp")) == 1
        return cls(st.axis_rank("tp"), st.device, () if alone else (st.group("mp"),))


class PartitionedModel(Protocol):
    """A ``DistributedModel`` as norms read it: its local parameters and which count."""

    @property
    def partitioned(self) -> bool: ...

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...
    def tied_duplicates(self) -> frozenset[str]: ...
    def is_distributed_parameter(self, param: torch.Tensor) -> bool: ...


def counted_parameters(scope: NormScope, model: PartitionedModel,
                       params: Iterable[torch.Tensor] | None = None
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(every local parameter with a gradient, the subset this rank counts in the norm)."""
    wanted = None if params is None else {id(p) for p in params}
    dup = model.tied_duplicates()
    tp0 = scope.tp_rank == 0
    everything: list[torch.Tensor] = []
    counted: list[torch.Tensor] = []
    for name, p in model.local_named_parameters():
        if p.grad is None or (wanted is not None and id(p) not in wanted):
            continue
        everything.append(p)
        if name not in dup and (tp0 or model.is_distributed_parameter(p)):
            counted.append(p)
    return everything, counted


def global_norm(scope: NormScope, counted: Sequence[torch.Tensor], norm_type: float = 2.0,
                extra_groups: Sequence[Any] = ()) -> torch.Tensor:
    """The norm of ``counted`` gradient tensors over the model-parallel group (and any
    ``extra_groups``), as an fp32 scalar on the tensors' device (CPU if there are none)."""
    p = float(norm_type)
    if p <= 0 and not math.isinf(p):
        raise SMPRuntimeError.build("norm_type must be > 0 or inf", norm_type,
                                    "smp clip_grad_norm_", "use 2.0 (default), 1.0 or inf")
    device = counted[0].device if counted else scope.device
    plain = [g for g in counted if not is_dtensor(g)]
    # ZeRO-1 (``extra_groups``): each expert slice is counted by its one owner per edp group
    experts = set() if extra_groups else _expert_grads()
    total = _power_sum([g.detach() for g in plain if id(g) not in experts], p, device)
    parts = [(tensors, [group]) for group, tensors in
             _sharded([g for g in counted if id(g) not in experts]).items()]
    if experts:  # sharded (sdp) over their edp shard group first, then over ep
        mine = [g for g in counted if id(g) in experts]
        parts.append(([_local(g).detach() for g in mine],
                      [*_sharded(mine), expert_groups.get_ep_process_group()]))
    for tensors, groups in parts:
        part = _power_sum(tensors, p, device)
        for group in groups:
            _reduce(part, p, group)
        total = torch.maximum(total, part) if math.isinf(p) else total + part
    for group in (*extra_groups, *scope.groups):
        _reduce(total, p, group)
    norm = total if math.isinf(p) else total.pow(1.0 / p)
    return norm.to(torch.float32)


def clip_grads(scope: NormScope, grads: Sequence[torch.Tensor],
               counted: Sequence[torch.Tensor], max_norm: float, norm_type: float = 2.0,
               error_if_nonfinite: bool = False, extra_groups: Sequence[Any] = ()) -> torch.Tensor:
    """Scale every tensor of ``grads`` so that the global norm of ``counted`` is at most
    ``max_norm``; returns that norm (before clipping), as ``clip_grad_norm_`` does."""
    total = global_norm(scope, counted, norm_type, extra_groups)
    if error_if_nonfinite and not torch.isfinite(total):
        raise SMPRuntimeError.build(
            "the total gradient norm is not finite, so it cannot be clipped", float(total),
            "smp clip_grad_norm_", "pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            local = _local(g)
            local.mul_(coef.to(local.device, local.dtype))
    return total


def clip_grad_norm_(scope: NormScope, model: PartitionedModel, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    params: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """Clip the partitioned ``model``'s gradients by the norm of the whole model: a collective
    over the model-parallel group; before partitioning a no-op returning 0."""
    if not model.partitioned:
        return torch.zeros((), dtype=torch.float32)
    everything, counted = counted_parameters(scope, model, params)
    return clip_grads(scope, _grads(everything), _grads(counted), max_norm, norm_type,
                      error_if_nonfinite)


def _expert_grads() -> set[int]:
    """ids of the gradients of this process model's expert slices (none at ep 1)."""
    model = context.current_model()
    names = getattr(model, "expert_names", None)
    if not names or expert_groups.ep_size() == 1 or not getattr(model, "partitioned", False):
        return set()
    return {id(p.grad) for n, p in model.local_named_parameters()  # type: ignore[union-attr]
            if n in names and p.grad is not None}


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard, else ``t`` itself)."""
    local: torch.Tensor = getattr(t, "_local_tensor", t)
    return local


def _grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def _sharded(tensors: Sequence[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """DTensor gradients by the process group of the mesh dimension they are sharded on
    (their local shards, detached)."""
    out: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        if not is_dtensor(t):
            continue
        from torch.distributed.tensor import Shard  # loaded: t is a DTensor

        dt: Any = t
        dims = [d for d, pl in enumerate(dt.placements) if isinstance(pl, Shard)]
        if len(dims) != 1:
            raise SMPRuntimeError.build(
                "a sharded gradient must be sharded on exactly one mesh dimension",
                dt.placements, "smp clip_grad_norm_", "shard parameters with FSDP2 only")
        out.setdefault(dt.device_mesh.get_group(dims[0]), []).append(_local(t).detach())
    return out


def _power_sum(tensors: Sequence[torch.Tensor], p: float,
               device: torch.device) -> torch.Tensor:
    """sum |t|_p^p over ``tensors`` (max for inf) in float64; each tensor's norm in fp32,
    as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(t, p, dtype=torch.float32).to(device)
                         for t in tensors]).double()
    return norms.max() if math.isinf(p) else norms.pow(p).sum()


def _reduce(value: torch.Tensor, p: float, group: Any) -> None:
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    dist.all_reduce(value, op=op, group=group)
