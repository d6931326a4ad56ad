"""What the sharding rules of ``passes.tensor_parallel`` read and write.

A value is replicated or split along one dim; rules carry a column linear's split to the
row linear that takes it, collecting the argument edits in ``Rewrites``. An op with no
rule raises ``Unsupported`` naming it, so the caller gives a reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from passes import meta
from passes.graph_utils import tensor_at
from passes.tensor_parallel.ops import SIZE_READS


class Unsupported(Exception):
    """A split value reaches an op the rules cannot carry it through (the reason)."""


@dataclass(frozen=True)
class Split:
    """Split along ``dim`` of the node's output; ``origin`` names the column linears behind it;
    ``block`` > 0: the dim is blocks (a batch merged with heads) each cut into the ranks'
    chunks."""

    dim: int
    origin: str
    block: int = 0


class Replicated:
    """A rule's answer for an output that is whole on every rank although an input is
    split (a sum over the split dim, completed by an all-reduce): ``REPLICATED``."""


REPLICATED = Replicated()


ArgPos = int | str | tuple[int, int]
"""Where a size argument is: a position, a kwarg name, or (position, index in a list)."""


@dataclass
class Rewrites:
    """Argument edits the rewrite applies: (node, position or kwarg name) -> divide by tp;
    plus the strided column linears (node name -> number of fused blocks)."""

    divide: list[tuple[torch.fx.Node, ArgPos]] = field(default_factory=list)
    batch: list[tuple[torch.fx.Node, ArgPos]] = field(default_factory=list)
    """Batch-size arguments: times tp when each rank gathers the batch (not prescaled)."""
    strided: dict[str, int] = field(default_factory=dict)
    runtime: list[torch.fx.Node] = field(default_factory=list)
    """Views whose size tuple is computed at run time (``local_sizes`` wraps it)."""
    batch_reads: list[torch.fx.Node] = field(default_factory=list)
    """``size()`` reads of a split value that include its batch: gathered when the batch is,
    which a view of the reassembled output would then get wrong (not prescaled)."""
    slices: dict[tuple[torch.fx.Node, torch.fx.Node], tuple[int, int]] = field(
        default_factory=dict)
    """(replicated operand, head-split consumer) -> (dim, block): the consumer reads this
    rank's heads of the operand (``tp_scatter``)."""
    copies: list[tuple[torch.fx.Node, torch.fx.Node]] = field(default_factory=list)
    """(replicated operand, consumer) where the operand broadcasts over a split value and
    may carry a gradient: each rank's gradient of it covers its part only, so it enters
    through ``tp_copy`` (backward all-reduce): a per-head norm's weight, a learned scale."""
    partial: dict[torch.fx.Node, float] = field(default_factory=dict)
    """Sums and means over the split dim -> scale: each rank's is over its part, so an
    all-reduce times the scale completes it (``tp_sum``: OLMo-2's full-width q/k norm)."""
    grad: set[torch.fx.Node] = field(default_factory=set)
    """The nodes a gradient can flow into (``grad_flow``), read by ``copy_operand``."""
    merged: list[torch.fx.Node] = field(default_factory=list)
    """Views merging the batch into a split dim (``Split.block``): under prescaled_batch
    false a gathered batch would change the blocks, which is not built."""
    gather: list[tuple[torch.fx.Node, torch.fx.Node]] = field(default_factory=list)
    """(consumer, replicated operand with the batch on dim 0) of a split value: gathered
    over the tp group's batches like the split value when not prescaled (an attention
    mask ``[N, 1, t, t]`` added to the scores of the gathered batch)."""
    reduced: set[torch.fx.Node] = field(default_factory=set)
    """Whole values computed from a split one (a sum over the split dim completed by
    ``tp_sum``, and what reads only such values: an RMS norm's ``rsqrt``): they hold the
    batch the split value holds, gathered already when not prescaled."""


def shape(n: Any) -> tuple[int, ...] | None:
    """The static output shape of ``n`` from ``meta.TENSOR``, when it is one tensor."""
    if not isinstance(n, torch.fx.Node):
        return None
    info = meta.TENSOR.get(n, None)
    return tuple(info.shape) if hasattr(info, "shape") else None


def norm_dim(dim: Any, rank: int) -> int:
    if not isinstance(dim, int):
        raise Unsupported(f"a dim argument {dim!r} that is not a constant")
    return dim + rank if dim < 0 else dim


def arg(n: torch.fx.Node, i: int, name: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def size_read(n: Any) -> bool:
    return isinstance(n, torch.fx.Node) and n.target in SIZE_READS


def elementwise_out(n: torch.fx.Node, split: dict[torch.fx.Node, Split],
                    rw: Rewrites | None = None, size: int = 1) -> Split:
    """Broadcasting: split inputs aligned on one dim; a replicated operand of size 1 there
    enters by ``tp_copy``, one of full size is sliced per rank (``slice_operand``)."""
    out = shape(n)
    if out is None:
        raise Unsupported(f"{n.name} has no static shape")
    from_end: set[tuple[int, int]] = set()
    origins: set[str] = set()
    for a in n.all_input_nodes:
        if a in split:
            s = shape(a)
            if s is None:
                raise Unsupported(f"{a.name} has no static shape")
            from_end.add((len(s) - split[a].dim, split[a].block))
            origins.update(split[a].origin.split(","))
    if len(from_end) != 1:
        raise Unsupported(f"{n.name} ({n.target}) combines values split on different dims")
    k, block = from_end.pop()
    for a in n.all_input_nodes:
        s = shape(a)
        if a in split or s is None:
            continue
        if len(s) < k or s[len(s) - k] == 1:  # broadcast over the split dim
            if rw is not None:
                if len(s) >= k:
                    batched_operand(n, a, out, rw)
                copy_operand(n, a, rw)
        elif rw is None or not slice_operand(n, a, k, size, rw, block):
            raise Unsupported(f"{n.name} ({n.target}) mixes a split value with the "
                              f"replicated {a.name} of size {s[len(s) - k]} on the split dim")
    return Split(len(out) - k, ",".join(sorted(origins)), block)


def copy_operand(n: torch.fx.Node, a: torch.fx.Node, rw: Rewrites) -> None:
    """Note a replicated operand ``a`` broadcast over ``n``'s split value for ``tp_copy``
    (``Rewrites.copies``), when a gradient can reach it (``Rewrites.grad``)."""
    if a in rw.grad:
        rw.copies.append((a, n))


NO_GRAD: frozenset[Any] = frozenset({"detach", torch.ops.aten.detach.default, "size",
                                     torch.ops.aten.sym_size.int, getattr, "dim"})
"""Ops whose value carries no gradient: detaching, and reading sizes, dtypes, devices
(``mask.to(weight.dtype)`` reads the weight but takes no gradient from it)."""


def grad_flow(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes whose value a gradient can flow into: floating values computed from a
    trainable parameter. The rewrite sees the whole model before it is split into stages,
    so its inputs are the batch (whose gradient the step does not return); buffers (RoPE's
    frequencies), masks and sizes carry none."""
    out: set[torch.fx.Node] = set()
    for n in gm.graph.nodes:
        dtype = getattr(meta.TENSOR.get(n, None), "dtype", None)  # a name: "torch.float32"
        if dtype is not None and "float" not in str(dtype) and "bfloat" not in str(dtype):
            continue
        if n.op == "placeholder":
            need = False
        elif n.op == "get_attr":
            need = bool(getattr(tensor_at(gm, str(n.target)), "requires_grad", False))
        else:
            need = n.target not in NO_GRAD and any(a in out for a in n.all_input_nodes)
        if need:
            out.add(n)
    return out


def batched_operand(n: torch.fx.Node, a: torch.fx.Node, out: tuple[int, ...],
                    rw: Rewrites) -> None:
    """Record a replicated operand with the batch on dim 0, gathered like the split chain's
    batch under ``prescaled_batch`` false (a batch of one is gathered too)."""
    s = shape(a)
    if a not in rw.reduced and s is not None and len(s) == len(out) and s[0] == out[0]:
        rw.gather.append((n, a))


def slice_operand(n: torch.fx.Node, operand: Any, k: int, size: int, rw: Rewrites,
                  block: int = 0) -> bool:
    """A replicated operand of a head-split op (grouped-query attention's key or value when
    tp does not divide the kv heads, a relative position bias): each rank takes its heads
    (``tp_scatter`` along the dim ``k`` from the end, in each block of ``block`` entries),
    when that dim has the split dim's full size."""
    s, out = shape(operand), shape(n)
    if s is None or out is None or len(s) < k or s[len(s) - k] % size:
        return False
    if s[len(s) - k] == 1:
        copy_operand(n, operand, rw)
        return True  # broadcast over the heads: nothing to cut
    if s[len(s) - k] != out[len(out) - k] or (block and (s[len(s) - k] % block or block % size)):
        return False
    rw.slices[operand, n] = (len(s) - k, block)
    batched_operand(n, operand, out, rw)
    return True


@dataclass(frozen=True)
class Ctx:
    """What a rule reads: the node, the splits found so far (graph order), the edits to
    add to, the degree, and the column linear behind a split's origin (``col_fused``)."""

    gm: torch.fx.GraphModule
    node: torch.fx.Node
    split: dict[torch.fx.Node, Split]
    rw: Rewrites
    size: int
    col_fused: Callable[[str], torch.fx.Node | None]

    @property
    def x(self) -> Any:
        """The first argument (the tensor most ops act on)."""
        return self.node.args[0] if self.node.args else None

    @property
    def s(self) -> Split | None:
        """The split of the first argument, None when it is replicated."""
        return self.split.get(self.x) if isinstance(self.x, torch.fx.Node) else None


Rule = Callable[[Ctx], Split | Replicated | None]
"""The split of a node's output given its inputs' (some split), or ``REPLICATED``; None:
no rule carries it (the caller names the op); ``Unsupported``: a rule that covers the op
but not this use."""


__all__ = ["REPLICATED", "ArgPos", "Ctx", "Replicated", "Rewrites", "Rule", "Split",
           "Unsupported", "arg", "batched_operand", "copy_operand", "elementwise_out",
           "grad_flow", "norm_dim", "shape", "size_read", "slice_operand"]
