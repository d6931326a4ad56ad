"""What the sharding rules of ``passes.tensor_parallel`` read and write.

Every value of the graph is *replicated* (the default), or *split* along one dimension
(each tp rank holds ``1/tp`` of it: ``Split.dim``). A column-parallel linear makes its
output split along the features; the rules (``rules.RULES``) carry a split through the
ops between it and the row-parallel linear that consumes it, collecting in ``Rewrites``
the argument edits the rewrite then applies (``view(b, t, n_head, hd)`` becomes
``view(b, t, n_head // tp, hd)``). Shapes come from ``passes.shape_prop``
(``meta.TENSOR``), which the pipeline runs before the rewrite. A rule reads one ``Ctx``.

An op with no rule for a split input raises ``Unsupported`` naming the op: the caller
leaves the region replicated with that reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from passes import meta
from passes.tensor_parallel.ops import SIZE_READS


class Unsupported(Exception):
    """A split value reaches an op the rules cannot carry it through (the reason)."""


@dataclass(frozen=True)
class Split:
    """Split along ``dim`` of the node's output; ``origin``: the column linears' nodes
    (comma-separated names: SwiGLU's ``gate * up`` has two)."""

    dim: int
    origin: str


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
    slices: dict[tuple[torch.fx.Node, torch.fx.Node], int] = field(default_factory=dict)
    """(replicated operand, head-split consumer) -> dim: the consumer reads this rank's
    heads of the operand (``tp_scatter``)."""
    gather: list[tuple[torch.fx.Node, torch.fx.Node]] = field(default_factory=list)
    """(consumer, replicated operand with the batch on dim 0) of a split value: gathered
    over the tp group's batches like the split value when not prescaled (an attention
    mask ``[N, 1, t, t]`` added to the scores of the gathered batch)."""


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
                    rw: Rewrites | None = None) -> Split:
    """Broadcasting: split inputs aligned on one dim (counted from the end); replicated
    tensor inputs must have size 1 there (RoPE's cos/sin, masks) or not reach it. One
    with the output's batch on dim 0 is noted in ``rw.gather`` (``batched_operand``)."""
    out = shape(n)
    if out is None:
        raise Unsupported(f"{n.name} has no static shape")
    from_end: set[int] = set()
    origins: set[str] = set()
    for a in n.all_input_nodes:
        if a in split:
            s = shape(a)
            if s is None:
                raise Unsupported(f"{a.name} has no static shape")
            from_end.add(len(s) - split[a].dim)
            origins.update(split[a].origin.split(","))
    if len(from_end) != 1:
        raise Unsupported(f"{n.name} ({n.target}) combines values split on different dims")
    k = from_end.pop()
    for a in n.all_input_nodes:
        s = shape(a)
        if a in split or s is None or len(s) < k:
            continue
        if s[len(s) - k] != 1:
            raise Unsupported(f"{n.name} ({n.target}) mixes a split value with the "
                              f"replicated {a.name} of size {s[len(s) - k]} on the split dim")
        if rw is not None:
            batched_operand(n, a, out, rw)
    return Split(len(out) - k, ",".join(sorted(origins)))


def batched_operand(n: torch.fx.Node, a: torch.fx.Node, out: tuple[int, ...],
                    rw: Rewrites) -> None:
    """Record a replicated operand that has the batch on dim 0 (an attention mask of
    shape (b, 1, t, t)): with ``prescaled_batch`` false the split chain runs on the tp
    group's gathered batch, so the operand is gathered too. A batch of one cannot be told
    from a broadcast: such an operand is gathered as well (tp equal copies of a constant
    broadcast the same way; a per-example one must be gathered)."""
    s = shape(a)
    if s is not None and len(s) == len(out) and s[0] == out[0]:
        rw.gather.append((n, a))


def slice_operand(n: torch.fx.Node, operand: Any, k: int, size: int, rw: Rewrites) -> bool:
    """A replicated operand of a head-split op (grouped-query attention's key or value when
    tp does not divide the kv heads): each rank takes its heads (``tp_scatter`` along the
    dim ``k`` from the end), when that dim has the split dim's full size."""
    s, out = shape(operand), shape(n)
    if s is None or out is None or len(s) < k or s[len(s) - k] % size:
        return False
    if s[len(s) - k] == 1:
        return True  # broadcast over the heads: nothing to cut
    if s[len(s) - k] != out[len(out) - k]:
        return False
    rw.slices[operand, n] = len(s) - k
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


Rule = Callable[[Ctx], Split | None]
"""The split of a node's output given its inputs' (some split); None: no rule carries it
(the caller names the op); ``Unsupported``: a rule that covers the op but not this use."""


__all__ = ["ArgPos", "Ctx", "Rewrites", "Rule", "Split", "Unsupported", "arg",
           "batched_operand", "elementwise_out", "norm_dim", "shape", "size_read",
           "slice_operand"]
