"""The tensor-parallel collectives the rewritten graph calls, as autograd functions.

``passes.tensor_parallel`` inserts these as ``call_function`` nodes; they run on the
``"tp"`` axis's group (``passes.axis_groups``). Every collective smp-fx's tensor
parallelism uses is built here from ``all_reduce`` and ``all_gather``, which gloo has, plus
``reduce_scatter`` where the backend has it (else an all-reduce followed by a local
slice), so CPU runs need nothing gloo lacks.

Without a bound group of more than one rank every function is the identity: a graph
rewritten for tp=1, or run by a pass that only propagates shapes, computes the same
function as the original.

* ``tp_copy``: forward identity, backward all-reduce (the input of a column-parallel linear).
* ``tp_reduce``: forward all-reduce (the output of a row-parallel linear), backward identity.
* ``tp_gather_last``: forward all-gather along the last dim (optionally sliced to the
  unpadded vocabulary), backward the local slice.
* ``tp_gather_batch`` / ``tp_split_batch``: ``prescaled_batch: false``: a distributed
  module sees the concatenated batches of its tp group, and each rank keeps its own part of
  the result. The backward of the split gathers the parts' gradients scaled by 1/tp and the
  backward of the gather keeps the local part scaled by tp, so every parameter inside sees
  the tp group's mean gradient and every rank's upstream sees its own.
* sequence parallelism (``optimize: "memory"``, ``passes.tensor_parallel.sequence``): between a
  row-parallel linear and the next column-parallel one each rank holds a chunk of the
  sequence dim ``dim``. ``tp_seq_reduce_scatter`` (the row output: forward reduce-scatter,
  backward all-gather) and ``tp_seq_gather`` (the column input: forward all-gather,
  backward reduce-scatter) replace ``tp_reduce`` and ``tp_copy``; at the edges of the
  chunked part ``tp_scatter`` (forward the local chunk, backward all-gather) and
  ``tp_seq_unscatter`` (forward all-gather, backward the local chunk) convert to and from
  replicated values. ``sum_grads`` completes the gradients of parameters that saw only
  this rank's chunk (layer norms, row biases).
* ``tp_scatter`` also gives a head-split op this rank's heads of a replicated operand
  (grouped-query attention's key or value when tp does not divide the kv heads, a
  relative position bias, ALiBi: then in each block of heads of a batch merged with them).
* ``tp_sum``: forward all-reduce of each rank's partial sum over a split dim (times a
  scale: a mean's parts), backward the scaled gradient (a full-width RMSNorm's mean).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from cost_model.errors import SMPRuntimeError
from passes.axis_groups import Summed, axis_group

_BOUND = axis_group("tp")


def active() -> bool:
    return _BOUND.active()


def group_all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``x`` reduced (``"sum"`` or ``"max"``) over the bound tp group, no autograd; ``x``
    itself without a group (for ops that build their own backward: the vocab-parallel
    cross entropy)."""
    if not active():
        return x
    return _BOUND.all_reduce(x, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)


def _all_gather(x: torch.Tensor, dim: int, block: int = 0) -> torch.Tensor:
    """The ranks' parts of ``dim`` joined; ``block`` > 0: the whole dim is blocks of that
    many entries, each rank holding its chunk of every block (``Split.block``)."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_BOUND.size)]
    dist.all_gather(parts, x, group=_BOUND.group)
    if not block:
        return torch.cat(parts, dim=dim)
    blocks = [p.unflatten(dim, (-1, block // _BOUND.size)) for p in parts]
    return torch.cat(blocks, dim=dim + 1).flatten(dim, dim + 1)


def _local(x: torch.Tensor, dim: int, block: int = 0) -> torch.Tensor:
    """This rank's chunk of ``dim`` (of each of its blocks of ``block`` entries)."""
    if not block:
        return x.chunk(_BOUND.size, dim=dim)[_BOUND.rank].contiguous()
    blocks = x.unflatten(dim, (-1, block))
    return blocks.chunk(_BOUND.size, dim=dim + 1)[_BOUND.rank].flatten(dim, dim + 1).contiguous()


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return _BOUND.all_reduce(g)


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, full: int | None) -> torch.Tensor:
        y = _all_gather(x, -1)
        ctx.pad = 0 if full is None else y.shape[-1] - full
        return y if full is None else y[..., :full]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        # the padding columns were dropped: their gradient is zero
        return _local(F.pad(g, (0, ctx.pad)) if ctx.pad else g, -1), None


class _GatherBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _all_gather(x, 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return _local(g, 0) * _BOUND.size


class _SplitBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _local(x, 0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return _all_gather(g, 0) / _BOUND.size


def tp_copy(x: torch.Tensor) -> torch.Tensor:
    return _Copy.apply(x) if active() else x


def tp_reduce(x: torch.Tensor) -> torch.Tensor:
    return Summed.apply(x, _BOUND) if active() else x


def tp_gather_last(x: torch.Tensor, full: int | None = None) -> torch.Tensor:
    """All-gather along the last dim; ``full``: keep only the first ``full`` features (the
    logits of a padded vocabulary, sliced back to the vocabulary)."""
    return _GatherLast.apply(x, full) if active() else x


def tp_gather_batch(x: torch.Tensor) -> torch.Tensor:
    return _GatherBatch.apply(x) if active() else x


def tp_split_batch(x: torch.Tensor) -> torch.Tensor:
    return _SplitBatch.apply(x) if active() else x


_reduce_scatter_into: Any = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None)
"""torch 2.13 renamed ``reduce_scatter_tensor`` (now deprecated) ``reduce_scatter_single``."""
_NATIVE_REDUCE_SCATTER: dict[str, bool] = {}
"""Per backend: whether the reduce-scatter works (gloo gained it in recent torch)."""


def _divides(x: torch.Tensor, dim: int) -> None:
    """Refuse a sequence that does not divide over the group before any rank calls the
    collective that would chunk it: every tp rank holds the same length here, so all raise
    alike, where a collective of unequal chunks would abort the process (gloo) or hang."""
    n, size = x.shape[dim], _BOUND.size
    if n % size:
        raise SMPRuntimeError.build(
            f"sequence parallelism ('optimize': 'memory') holds 1/{size} of the sequence on "
            f"each tensor-parallel rank: dim {dim} of a value of shape {tuple(x.shape)} does "
            f"not divide over tensor_parallel_degree {size}", n, "a sequence-parallel "
            "collective of this step",
            f"pad every batch to a multiple of {size} tokens (transformers' "
            f"DataCollatorWithPadding(tokenizer, pad_to_multiple_of={size})), or set "
            "'optimize': 'speed' (no sequence parallelism)")


def _reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over the group, keep this rank's chunk of ``dim``: the backend's reduce-scatter
    (half an all-reduce's traffic), else, where it has none (gloo of older torch), an
    all-reduce and a slice: the same sums."""
    _divides(x, dim)
    backend = str(dist.get_backend(_BOUND.group))
    if _reduce_scatter_into is not None and _NATIVE_REDUCE_SCATTER.get(backend, True):
        src = x.movedim(dim, 0).contiguous()
        out = src.new_empty((src.shape[0] // _BOUND.size, *src.shape[1:]))
        try:
            _reduce_scatter_into(out, src, group=_BOUND.group)
            return out.movedim(0, dim).contiguous()
        except (RuntimeError, NotImplementedError, AttributeError):
            _NATIVE_REDUCE_SCATTER[backend] = False
    return _local(_BOUND.all_reduce(x), dim)


def _along_dim(name: str, forward: Callable[[torch.Tensor, int], torch.Tensor],
               backward: Callable[[torch.Tensor, int], torch.Tensor]) -> Any:
    """An autograd function of ``(x, dim)``: ``forward(x, dim)``, gradient
    ``backward(g, dim)`` (the sequence-parallel and head-cut collectives differ only in
    which pair of ``_all_gather``, ``_reduce_scatter`` and ``_local`` they use)."""

    def fwd(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return forward(x, dim)

    def bwd(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return backward(g, ctx.dim), None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_SeqGather = _along_dim("_SeqGather", _all_gather, _reduce_scatter)
_SeqReduceScatter = _along_dim("_SeqReduceScatter", _reduce_scatter, _all_gather)
_SeqUnscatter = _along_dim("_SeqUnscatter", _all_gather, _local)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, block: int) -> torch.Tensor:
        ctx.dim, ctx.block = dim, block
        if not block:  # a block of heads divides by construction (the rewrite checked it)
            _divides(x, dim)
        return _local(x, dim, block)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(g, ctx.dim, ctx.block), None, None


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        out = _BOUND.all_reduce(x)
        return out * scale if scale != 1.0 else out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (g * ctx.scale if ctx.scale != 1.0 else g), None


def tp_seq_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _SeqGather.apply(x, dim) if active() else x


def tp_seq_reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _SeqReduceScatter.apply(x, dim) if active() else x


def tp_scatter(x: torch.Tensor, dim: int, block: int = 0) -> torch.Tensor:
    """This rank's chunk of a replicated ``x`` along ``dim`` (of each of its blocks of
    ``block`` entries, when ``block`` > 0); backward all-gather."""
    return _Scatter.apply(x, dim, block) if active() else x


def tp_sum(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The sum over the group of each rank's partial sum (or mean, with ``scale`` 1/tp)
    over its part of a split dim; backward the gradient times ``scale``, as it stands (the
    replicated result enters the split ops by ``tp_copy``, which sums their parts)."""
    return _Sum.apply(x, scale) if active() else x


def tp_seq_unscatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _SeqUnscatter.apply(x, dim) if active() else x


def tp_seq_full_shape(x: torch.Tensor, dim: int, gathered: bool) -> torch.Size:
    """The replicated value's shape read from this rank's chunk, without communication:
    the sequence dim times the degree; ``gathered``: the batch back to this rank's."""
    if not active():
        return x.shape
    shape = list(x.shape)
    shape[dim] *= _BOUND.size
    if gathered:
        shape[0] //= _BOUND.size
    return torch.Size(shape)


def tp_vocab_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int | None = None,
                       padding_idx: int | None = None) -> torch.Tensor:
    """Embedding lookup with ``weight`` this rank's block of rows ``[start, start + n)``
    (``start`` None: ``rank * n``): ids outside the block give zeros, and the sum over the
    group is the full lookup (forward all-reduce, backward identity, as ``tp_reduce``).
    ``padding_idx`` (a row of the full table) gets no gradient, on the rank that holds it.
    Without a group the partial lookup of ``start``'s block is returned as it is (the
    ranks' outputs sum to the full lookup), or the plain lookup when ``start`` is None."""
    if not active() and start is None:
        return F.embedding(ids, weight, padding_idx)
    rows = weight.shape[0]
    first = _BOUND.rank * rows if start is None else start
    local = ids - first
    outside = (local < 0) | (local >= rows)
    pad = None if padding_idx is None or not 0 <= padding_idx - first < rows \
        else padding_idx - first
    out = F.embedding(local.masked_fill(outside, 0), weight, pad).masked_fill(
        outside.unsqueeze(-1), 0.0)
    return Summed.apply(out, _BOUND) if active() else out


def average_grads(params: list[torch.nn.Parameter]) -> None:
    """Average the ``.grad`` of ``params`` over the tp group (replicated parameters under
    ``prescaled_batch: false``, whose tp ranks saw different examples)."""
    _reduce_grads(params, _BOUND.size)


def sum_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the ``.grad`` of ``params`` over the tp group: parameters read only by
    sequence-parallel ops, whose gradient on each rank covers its chunk of the sequence."""
    _reduce_grads(params, 1)


def _reduce_grads(params: list[torch.nn.Parameter], divisor: int) -> None:
    """All-reduce the gradients of ``params`` as one flat buffer, divided by ``divisor``."""
    if not active():
        return
    # a gradient sharded by sharded data parallelism (a DTensor) reduces its local shard
    grads = [getattr(p.grad, "_local_tensor", p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if divisor != 1:
        flat /= divisor
    dist.all_reduce(flat, group=_BOUND.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
