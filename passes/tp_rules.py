"""Sharding propagation rules for ``passes.tensor_parallel``.

Every value of the graph is *replicated* (the default), or *split* along one dimension
(each tp rank holds ``1/tp`` of it: ``Split.dim``). A column-parallel linear makes its
output split along the features; the rules below carry a split through the ops between it
and the row-parallel linear that consumes it, rewriting the shape constants the ops name
(``view(b, t, n_head, hd)`` becomes ``view(b, t, n_head // tp, hd)``). Shapes come from
``passes.shape_prop`` (``meta.TENSOR``), which the pipeline runs before the rewrite.

An op with no rule for a split input raises ``Unsupported`` naming the op: the caller
leaves the region replicated with that reason.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.nn import functional as F

from passes import meta


class Unsupported(Exception):
    """A split value reaches an op the rules cannot carry it through (the reason)."""


@dataclass(frozen=True)
class Split:
    """Split along ``dim`` of the node's output; ``origin``: the column linears' nodes
    (comma-separated names: SwiGLU's ``gate * up`` has two)."""

    dim: int
    origin: str


@dataclass
class Rewrites:
    """Argument edits the rewrite applies: (node, position or kwarg name) -> divide by tp;
    plus the strided column linears (node name -> number of fused blocks)."""

    divide: list[tuple[torch.fx.Node, int | str]] = field(default_factory=list)
    batch: list[tuple[torch.fx.Node, int]] = field(default_factory=list)
    """Batch-size arguments: times tp when each rank gathers the batch (not prescaled)."""
    strided: dict[str, int] = field(default_factory=dict)
    gather: list[tuple[torch.fx.Node, torch.fx.Node]] = field(default_factory=list)
    """(consumer, replicated operand with a batch dim) of a split value: the operand is
    gathered over the tp group's batches like the split value (not prescaled), e.g. a
    padding mask ``[N, 1, 1, S]`` added to the scores of the gathered batch."""


def shape(n: Any) -> tuple[int, ...] | None:
    """The static output shape of ``n`` from ``meta.TENSOR``, when it is one tensor."""
    if not isinstance(n, torch.fx.Node):
        return None
    info = meta.TENSOR.get(n, None)
    return tuple(info.shape) if hasattr(info, "shape") else None


def _norm(dim: Any, rank: int) -> int:
    if not isinstance(dim, int):
        raise Unsupported(f"a dim argument {dim!r} that is not a constant")
    return dim + rank if dim < 0 else dim


PASS_THROUGH_METHODS = frozenset({"contiguous", "float", "half", "to", "type_as", "clone"})
TRANSPOSES: frozenset[Any] = frozenset({"transpose", torch.transpose,
                                        torch.ops.aten.transpose.int})
VIEWS: frozenset[Any] = frozenset({"view", "reshape", torch.reshape,
                                   torch.ops.aten.view.default,
                                   torch.ops.aten.reshape.default})
SPLITS: frozenset[Any] = frozenset({"split", torch.split, torch.ops.aten.split.Tensor})
SDPA: frozenset[Any] = frozenset({F.scaled_dot_product_attention,
                                  torch.ops.aten.scaled_dot_product_attention.default})
SOFTMAX: frozenset[Any] = frozenset({"softmax", F.softmax, torch.softmax,
                                     torch.ops.aten._softmax.default})
MATMUL: frozenset[Any] = frozenset({"matmul", torch.matmul, operator.matmul, torch.bmm,
                                    torch.ops.aten.matmul.default, torch.ops.aten.bmm.default})


def _arg(n: torch.fx.Node, i: int, name: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def elementwise_out(n: torch.fx.Node, split: dict[torch.fx.Node, Split],
                    rw: Rewrites | None = None) -> Split:
    """Broadcasting: split inputs aligned on one dim (counted from the end); replicated
    tensor inputs must have size 1 there (RoPE's cos/sin, masks) or not reach it. One
    that reaches the batch dim (dim 0) with more than 1 row is noted in ``rw.gather``."""
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
        if rw is not None and len(s) == len(out) and s[0] != 1:
            rw.gather.append((n, a))
    return Split(len(out) - k, ",".join(sorted(origins)))


def _view(n: torch.fx.Node, s: Split, rw: Rewrites, size: int) -> Split:
    """A reshape keeps the split when the split dim is the leading factor of an output dim
    (merge) or an output dim is its leading factor (split into heads)."""
    src, out = shape(n.args[0]), shape(n)
    if src is None or out is None:
        raise Unsupported(f"{n.name} has no static shape")
    before = math.prod(src[:s.dim])
    for j in range(len(out)):
        if math.prod(out[:j]) != before:
            continue
        d, o = src[s.dim], out[j]
        ok = (d % o == 0 and math.prod(out[j:]) >= d) or (o % d == 0)
        if not ok or o % size:
            break
        if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)):
            raise Unsupported(f"{n.name} ({n.target}) takes its shape as one list")
        pos = j + 1
        if n.args[pos] != -1:
            rw.divide.append((n, pos))
        if j != 0 and src[0] == out[0] and n.args[1] != -1:
            rw.batch.append((n, 1))
        return Split(j, s.origin)
    raise Unsupported(f"{n.name} ({n.target}) reshapes the split dim {s.dim} of "
                      f"{src} into {out} across tp={size} pieces")


def _size_of(piece: Any, n: torch.fx.Node) -> int:
    """The int a split size stands for (a constant, or a ``size()`` read: its first
    output's size along the split)."""
    if isinstance(piece, int):
        return piece
    first = next(u for u in n.users if u.target is operator.getitem and u.args[1] == 0)
    out = shape(first)
    dim = _arg(n, 2, "dim", 0)
    if out is None:
        raise Unsupported(f"{n.name} has no static shape")
    return out[dim]


def propagate(n: torch.fx.Node, split: dict[torch.fx.Node, Split], rw: Rewrites,
              size: int, col_fused: Callable[[str], torch.fx.Node | None]) -> Split | None:
    """The split of ``n``'s output given its inputs' (some split), or ``Unsupported``."""
    t = n.target
    x = n.args[0] if n.args else None
    s = split.get(x) if isinstance(x, torch.fx.Node) else None
    if n.op == "call_method" and t in PASS_THROUGH_METHODS and s is not None:
        return s
    if t in TRANSPOSES and s is not None:
        rank = len(shape(x) or ())
        a, b = _norm(n.args[1], rank), _norm(n.args[2], rank)
        return Split(b if s.dim == a else a if s.dim == b else s.dim, s.origin)
    if t in ("permute", torch.permute) and s is not None:
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) \
            else n.args[1:]
        rank = len(dims)
        return Split([_norm(d, rank) for d in dims].index(s.dim), s.origin)
    if t in VIEWS and s is not None:
        return _view(n, s, rw, size)
    if t in SOFTMAX and s is not None:
        dim = _arg(n, 1, "dim")
        if _norm(dim, len(shape(x) or ())) == s.dim:
            raise Unsupported(f"{n.name} normalises over the split dim")
        return s
    if t in SPLITS and s is not None:
        dim = _norm(_arg(n, 2, "dim", 0), len(shape(x) or ()))
        if dim != s.dim:
            return s
        whole, piece = (shape(x) or (0,) * (dim + 1))[dim], n.args[1]
        src = col_fused(s.origin)
        if src is not x or not isinstance(piece, (int, torch.fx.Node)):
            raise Unsupported(f"{n.name} splits the split dim of a value that is not a "
                              "column linear's output (a fused projection)")
        rw.strided[s.origin] = whole // _size_of(piece, n)
        rw.divide.append((n, 1))
        return s
    if n.op == "call_function" and t is operator.getitem and s is not None:
        return s
    if t in SDPA:
        qkv: list[Any] = list(n.args[:3])
        if not all(a in split and split[a].dim == split[qkv[0]].dim for a in qkv):
            raise Unsupported(f"{n.name} attends over q, k, v not all split by heads")
        if split[qkv[0]].dim >= len(shape(qkv[0]) or ()) - 2:
            raise Unsupported(f"{n.name}'s q is split along its sequence or head features")
        mask = _arg(n, 3, "attn_mask")
        if isinstance(mask, torch.fx.Node) and mask not in split:
            ms = shape(mask)
            k = len(shape(qkv[0]) or ()) - split[qkv[0]].dim
            if ms is None or (len(ms) >= k and ms[len(ms) - k] != 1):
                raise Unsupported(f"{n.name}'s mask {mask.name} is not broadcast over heads")
        return split[qkv[0]]
    if t in MATMUL:
        lhs: Any = n.args[0]
        rhs: Any = n.args[1]
        sa, sb = split.get(lhs), split.get(rhs)
        ra = len(shape(lhs) or ())
        if sa and sb and ra - sa.dim == len(shape(rhs) or ()) - sb.dim and ra - sa.dim > 2:
            return Split(len(shape(n) or ()) - (ra - sa.dim), sa.origin)
        raise Unsupported(f"{n.name} ({t}) multiplies along a split dim")
    return None
