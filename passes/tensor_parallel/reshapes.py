"""The sharding rules of shape ops: transposes, permutes, views and reshapes, ``split``
of a fused projection, unsqueeze, expand, slices, concatenation.

A reshape keeps a split when the split dim stays a whole factor of one output dim; the
size arguments the op names are then this rank's (``Rewrites.divide``), and the batch a
size names is multiplied when the tp group's batches are gathered (``Rewrites.batch``).
``rules.RULES`` maps the op targets to these functions.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from passes.tensor_parallel.ops import VIEWS
from passes.tensor_parallel.propagation import (
    ArgPos,
    Ctx,
    Rewrites,
    Split,
    Unsupported,
    arg,
    norm_dim,
    shape,
    size_read,
)


def _view(n: torch.fx.Node, s: Split, rw: Rewrites, size: int) -> Split:
    """A reshape keeps the split when the split dim is the leading factor of an output dim
    (merge) or an output dim is its leading factor (split into heads). The sizes are
    separate arguments (``x.view(b, t, h, d)``) or one list (``aten.view(x, [b, t, h, d])``)."""
    src, out = shape(n.args[0]), shape(n)
    if src is None or out is None:
        raise Unsupported(f"{n.name} has no static shape")
    runtime = len(out) > 1 and len(n.args) == 2 and isinstance(n.args[1], torch.fx.Node)
    if runtime:  # HF Conv1D under fx: x.view(x.size()[:-1] + (nf,)), a tuple built at run
        return _view_runtime_sizes(n, s, src, out, rw, size)  # time
    listed = len(n.args) == 2 and isinstance(n.args[1], (tuple, list))
    dims: list[Any] = list(n.args[1]) if listed else list(n.args[1:])  # type: ignore[arg-type]
    if len(dims) != len(out):
        raise Unsupported(f"{n.name} ({n.target}) has {len(dims)} sizes for {len(out)} dims")

    def at(k: int) -> int | tuple[int, int]:
        return (1, k) if listed else k + 1

    before = math.prod(src[:s.dim])
    for j in range(len(out)):
        if math.prod(out[:j]) != before:
            continue
        d, o = src[s.dim], out[j]
        ok = (d % o == 0 and math.prod(out[j:]) >= d) or (o % d == 0)
        if not ok or o % size:
            break
        if dims[j] != -1 and not size_read(dims[j]):
            rw.divide.append((n, at(j)))
        _note_batch(n, j, dims[0], src, out, at(0), rw)
        return Split(j, s.origin)
    raise Unsupported(f"{n.name} ({n.target}) reshapes the split dim {s.dim} of "
                      f"{src} into {out} across tp={size} pieces")


def _view_runtime_sizes(n: torch.fx.Node, s: Split, src: tuple[int, ...],
                        out: tuple[int, ...], rw: Rewrites, size: int) -> Split:
    """A view whose sizes are one tuple computed at run time: only a split that stays the
    last dim is carried (a linear's 2-D output viewed back to ``(b, t, features)``); the
    rewrite wraps the tuple in ``local_sizes``."""
    if s.dim != len(src) - 1 or out[-1] != src[-1] or out[-1] % size:
        raise Unsupported(f"{n.name} ({n.target}) reshapes the split dim with sizes "
                          "computed at run time")
    rw.runtime.append(n)
    return Split(len(out) - 1, s.origin)


def local_sizes(sizes: Sequence[int], size: int) -> tuple[int, ...]:
    """A view's run-time sizes for this rank's piece: the last (split) dim ``// size``, the
    first inferred (-1), so a batch gathered over the tp group fits as well."""
    return (-1, *sizes[1:-1], sizes[-1] // size)


def _expand(n: torch.fx.Node, s: Split, rw: Rewrites) -> Split:
    """``expand`` (GQA's repeat of the kv heads): the split dim keeps its place counted
    from the end; its size argument, unless -1, becomes this rank's."""
    src, out = shape(n.args[0]), shape(n)
    sizes = n.args[1] if len(n.args) == 2 else None
    if src is None or out is None or not isinstance(sizes, (list, tuple)):
        raise Unsupported(f"{n.name} ({n.target}) has no static shape or size list")
    j = s.dim + len(out) - len(src)
    if sizes[j] != -1:
        rw.divide.append((n, (1, j)))
    _note_batch(n, j, sizes[0], src, out, (1, 0), rw)
    return Split(j, s.origin)


def _reads_batch(value: Any) -> bool:
    """Whether a size argument reads dim 0 of a graph input (torch.export's
    ``sym_size(input_ids, 0)``): the local batch size, which a gathered batch multiplies."""
    return (size_read(value) and len(value.args) == 2 and isinstance(value.args[1], int)
            and value.args[1] == 0 and isinstance(value.args[0], torch.fx.Node)
            and value.args[0].op == "placeholder")


def _note_batch(n: torch.fx.Node, j: int, first: Any, src: tuple[int, ...],
                out: tuple[int, ...], pos: ArgPos, rw: Rewrites) -> None:
    """A view or expand that keeps the split off dim 0 names the batch in its first size
    (unless -1) when dim 0 is unchanged or that size reads the input's batch: it is
    multiplied by tp when the batch is gathered (``rw.batch``)."""
    if j != 0 and first != -1 and (src[0] == out[0] or _reads_batch(first)):
        rw.batch.append((n, pos))


def _size_of(piece: Any, n: torch.fx.Node) -> int:
    """The int a split size stands for (a constant, or a ``size()`` read: its first
    output's size along the split)."""
    if isinstance(piece, int):
        return piece
    first = next(u for u in n.users if u.target is operator.getitem and u.args[1] == 0)
    out = shape(first)
    dim = arg(n, 2, "dim", 0)
    if out is None:
        raise Unsupported(f"{n.name} has no static shape")
    return out[dim]


def transpose(c: Ctx, s: Split) -> Split:
    """The split dim follows the swap."""
    rank = len(shape(c.x) or ())
    a, b = norm_dim(c.node.args[1], rank), norm_dim(c.node.args[2], rank)
    return Split(b if s.dim == a else a if s.dim == b else s.dim, s.origin)


def permute(c: Ctx, s: Split) -> Split:
    """The split dim goes where the permutation puts it."""
    n = c.node
    dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) \
        else n.args[1:]
    rank = len(dims)
    return Split([norm_dim(d, rank) for d in dims].index(s.dim), s.origin)


def reshape(c: Ctx, s: Split) -> Split:
    """``view`` / ``reshape``: by ``_view`` (the heads' split and merge)."""
    return _view(c.node, s, c.rw, c.size)


def split_fused(c: Ctx, s: Split) -> Split:
    """``split`` along another dim keeps the split; along the split dim it must cut a
    column linear's own output (a fused q/k/v projection): that linear becomes strided
    (each block sharded alike) and the piece size is divided."""
    n, x = c.node, c.x
    dim = norm_dim(arg(n, 2, "dim", 0), len(shape(x) or ()))
    if dim != s.dim:
        return s
    whole, piece = (shape(x) or (0,) * (dim + 1))[dim], n.args[1]
    src = c.col_fused(s.origin)
    while (x is not src and isinstance(x, torch.fx.Node) and x.target in VIEWS
           and isinstance(x.args[0], torch.fx.Node) and x.args[0] in c.split
           and c.split[x.args[0]].origin == s.origin
           and dim == len(shape(x) or ()) - 1
           and (shape(x) or ())[-1:] == (shape(x.args[0]) or ())[-1:]):
        x = x.args[0]  # Conv1D: the addmm's 2-D output viewed back to (b, t, 3c)
    if src is not x or not isinstance(piece, (int, torch.fx.Node)):
        raise Unsupported(f"{n.name} splits the split dim of a value that is not a "
                          "column linear's output (a fused projection)")
    c.rw.strided[s.origin] = whole // _size_of(piece, n)
    c.rw.divide.append((n, 1))
    return s


def unsqueeze(c: Ctx, s: Split) -> Split:
    """A new dim before the split dim moves it by one."""
    at_dim = norm_dim(arg(c.node, 1, "dim", 0), len(shape(c.node) or ()))
    return Split(s.dim + (1 if at_dim <= s.dim else 0), s.origin)


def expand(c: Ctx, s: Split) -> Split:
    """By ``_expand`` (grouped-query attention's repeated kv heads)."""
    return _expand(c.node, s, c.rw)


def narrow(c: Ctx, s: Split) -> Split:
    """A slice (RoPE's halves) along another dim than the split one."""
    if norm_dim(arg(c.node, 1, "dim", 0), len(shape(c.x) or ())) == s.dim:
        raise Unsupported(f"{c.node.name} slices the split dim")
    return s


def cat(c: Ctx) -> Split:
    """Values all split alike, concatenated along another dim (RoPE's rotated halves)."""
    n = c.node
    listed = n.args[0] if isinstance(n.args[0], (list, tuple)) else ()
    parts = [p for p in listed if isinstance(p, torch.fx.Node) and p in c.split]
    dim = norm_dim(arg(n, 1, "dim", 0), len(shape(n) or ()))
    if not parts or len(parts) != len(listed) or len({c.split[p].dim for p in parts}) != 1:
        raise Unsupported(f"{n.name} concatenates split and replicated values")
    if dim == c.split[parts[0]].dim:
        raise Unsupported(f"{n.name} concatenates along the split dim")
    return Split(c.split[parts[0]].dim, ",".join(sorted({c.split[p].origin for p in parts})))


__all__ = ["cat", "expand", "local_sizes", "narrow", "permute", "reshape", "split_fused",
           "transpose", "unsqueeze"]
