"""The context-parallel operations the rewritten graph calls, with their autograd.

A sequence of length S is cut into 2cp equal chunks; cp rank r holds chunks r and
2cp - 1 - r (causal load balance: each rank's queries see as many keys in total).
``local_index`` is the global positions of those tokens. They run on the ``"cp"`` axis's
group (``passes.axis_groups``); without a bound group of more than one rank every operation is the
identity, so a rewritten graph computes the original function in one process.

* ``cp_split``: the local tokens of a whole input (backward: the pieces summed over cp);
* ``cp_localize``: the local rows of a value every rank computes whole (positions, masks);
* ``cp_gather``: the whole sequence from the chunks, in order (a model output; backward:
  this rank's rows of the gradient, which every rank computes whole from the same loss);
* ``cp_gather_kv``: the same forward for keys and values; backward sums every rank's
  gradient of them before keeping the local rows (every rank's queries read every key);
* ``cp_sum``: a per-rank sum (a loss over the rank's tokens) summed over cp; its gradient
  passes through (every rank's backward covers its own tokens' part of the same total).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPRuntimeError
from passes.axis_groups import Summed, axis_group

_BOUND = axis_group("cp")


def size() -> int:
    return _BOUND.size if active() else 1


def active() -> bool:
    return _BOUND.active()


def local_index(length: int, degree: int, rank: int, device: torch.device | None = None
                ) -> torch.Tensor:
    """Global positions of ``rank``'s tokens among ``length``: chunks rank and
    2 degree - 1 - rank of 2 degree. A length that does not split is refused, naming the
    multiple to pad to."""
    parts = 2 * degree
    if length % parts:
        raise SMPRuntimeError.build(
            f"context parallelism over {degree} ranks cuts the sequence into {parts} equal "
            f"chunks; the sequence length must be a multiple of {parts}", length,
            "the model's first step", f"pad the sequences to a multiple of {parts} "
            f"(e.g. {length + parts - length % parts}) and mask the padding")
    chunk = length // parts
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((parts - 1 - rank) * chunk, (parts - rank) * chunk, device=device)
    return torch.cat([first, second])


def _mine(length: int, device: torch.device) -> torch.Tensor:
    return local_index(length, _BOUND.size, _BOUND.rank, device)


def _order(local: int, device: torch.device) -> torch.Tensor:
    """Where each global position sits in the ranks' chunks concatenated in rank order."""
    length = local * _BOUND.size
    held = torch.cat([local_index(length, _BOUND.size, r, device)
                      for r in range(_BOUND.size)])
    return torch.argsort(held)


def _all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
             for _ in range(_BOUND.size)]
    dist.all_gather(parts, x.contiguous(), group=_BOUND.group)
    whole = torch.cat(parts, dim=dim)
    return whole.index_select(dim, _order(x.shape[dim], x.device))


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim, ctx.length = dim, x.shape[dim]
        return x.index_select(dim, _mine(x.shape[dim], x.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.length
        whole = grad.new_zeros(shape).index_copy(ctx.dim, _mine(ctx.length, grad.device), grad)
        return _BOUND.all_reduce(whole), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, summed: bool) -> torch.Tensor:
        ctx.dim, ctx.summed = dim, summed
        return _all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        full = _BOUND.all_reduce(grad) if ctx.summed else grad
        return full.index_select(ctx.dim, _mine(grad.shape[ctx.dim], grad.device)), None, None


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


def cp_split(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's tokens of the whole input ``x`` (sequence along ``dim``)."""
    if not active():
        return x
    dim = _dim(x, dim)
    if x.requires_grad:
        out: torch.Tensor = _Split.apply(x, dim)
        return out
    return x.index_select(dim, _mine(x.shape[dim], x.device))


def cp_localize(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The local rows of ``x`` along each of ``dims`` (a whole-sequence value that meets
    the local tokens: positions' embeddings or rotations). No communication: the
    gradient of the rows other ranks hold is theirs, summed with the parameters'."""
    if not active():
        return x
    for dim in dims:
        d = _dim(x, dim)
        if x.shape[d] > 1:  # a broadcast dimension stays
            x = x.index_select(d, _mine(x.shape[d], x.device))
    return x


def cp_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole sequence, in order, from every rank's tokens of ``x`` (a model output)."""
    if not active():
        return x
    out: torch.Tensor = _Gather.apply(x, _dim(x, dim), False)
    return out


def cp_gather_kv(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Keys or values of the whole sequence; backward sums the ranks' gradients of them."""
    if not active():
        return x
    out: torch.Tensor = _Gather.apply(x, _dim(x, dim), True)
    return out


def cp_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the cp group; the gradient of each rank's ``x`` is the sum's."""
    if not active():
        return x
    out: torch.Tensor = Summed.apply(x, _BOUND)
    return out


def sum_over_group(x: torch.Tensor) -> None:
    """``x`` summed in place over the bound cp group (gradients); untouched without one."""
    if active():
        dist.all_reduce(x, group=_BOUND.group)


def query_positions(length: int, device: torch.device) -> torch.Tensor:
    """Global positions of this rank's queries among ``length`` keys (all, unbound)."""
    if not active():
        return torch.arange(length, device=device)
    return _mine(length, device)


__all__ = ["active", "cp_gather", "cp_gather_kv", "cp_localize", "cp_split", "cp_sum",
           "local_index", "query_positions", "size", "sum_over_group"]
