"""The sharding rules of shape ops: transposes, permutes, views and reshapes, ``split`` /
``chunk`` of a fused projection, unsqueeze, expand, select, slices, concatenation, stacks.

A reshape keeps a split when each rank's chunk stays whole rows of one output dim.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from passes.tensor_parallel.ops import STACKS, VIEWS
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
    slice_operand,
)


def _moved(s: Split, dim: int) -> Split:
    return dataclasses.replace(s, dim=dim)


def _view(n: torch.fx.Node, s: Split, rw: Rewrites, size: int) -> Split:
    """A reshape keeps the split when, in flat order, each rank's chunk of every block is
    whole rows of one output dim: heads split ``(b, t, c) -> (b, t, h, d)``, merged back,
    or moved into the batch ``(b, h, t, d) -> (b * h, t, d)``."""
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

    j = _view_dim(src, out, s, size)
    if j is not None:
        o = math.prod(src[:s.dim]) * (src[s.dim] // s.block if s.block else 1) \
            // math.prod(out[:j])
        if dims[j] != -1 and not size_read(dims[j]):
            rw.divide.append((n, at(j)))
        if o > 1:
            rw.merged.append(n)
        _note_batch(n, j, dims[0], src, out, at(0), rw)
        return Split(j, s.origin, out[j] // o if o > 1 else 0)
    raise Unsupported(f"{n.name} ({n.target}) reshapes the split dim {s.dim} of "
                      f"{src} into {out} across tp={size} pieces")


def _view_dim(src: tuple[int, ...], out: tuple[int, ...], s: Split, size: int) -> int | None:
    """The output dim holding the split after reshaping ``src`` into ``out``, or None; a
    size-1 dim where the split would start (one kv head) refuses."""
    a = math.prod(src[:s.dim]) * (src[s.dim] // s.block if s.block else 1)
    for j in range(len(out)):
        if out[j] == 1 and j < s.dim and out[:j + 1] == src[:j + 1]:
            continue
        c = math.prod(out[:j])
        if a % c or out[j] % (a // c):
            continue
        rows = out[j] // (a // c)
        if rows == 1 and out[j] > 1:
            continue  # dim j is all blocks: the split starts in the next one
        return j if rows % size == 0 else None
    return None


def flatten(c: Ctx, s: Split) -> Split:
    """``flatten`` (GPT-J's interleaved rotation flattened back): a reshape that names no
    size, by the shapes alone."""
    src, out = shape(c.x), shape(c.node)
    j = None if src is None or out is None else _view_dim(src, out, s, c.size)
    if j is None or src is None or out is None:
        raise Unsupported(f"{c.node.name} flattens the split dim across tp={c.size} pieces")
    o = math.prod(src[:s.dim]) * (src[s.dim] // s.block if s.block else 1) // math.prod(out[:j])
    if o > 1:
        c.rw.merged.append(c.node)
    return Split(j, s.origin, out[j] // o if o > 1 else 0)


def repeat(c: Ctx, s: Split) -> Split:
    """``repeat`` (DeBERTa's relative embeddings): tiles along the split dim make it blocks."""
    src, out = shape(c.x), shape(c.node)
    if src is None or out is None:
        raise Unsupported(f"{c.node.name} has no static shape")
    d = s.dim + len(out) - len(src)
    if out[d] == src[s.dim]:
        return _moved(s, d)
    return Split(d, s.origin, s.block or src[s.dim])


def gather(c: Ctx, s: Split) -> Split:
    """``gather`` along another dim than the split one (DeBERTa's relative positions
    picked per query): the index is cut to this rank's part like an operand."""
    n = c.node
    rank = len(shape(c.x) or ())
    dim, index = norm_dim(arg(n, 1, "dim", 0), rank), arg(n, 2, "index")
    if dim == s.dim:
        raise Unsupported(f"{n.name} gathers along the split dim")
    if isinstance(index, torch.fx.Node) and index in c.split:
        if (c.split[index].dim, c.split[index].block) != (s.dim, s.block):
            raise Unsupported(f"{n.name}'s index is split unlike its input")
    elif not slice_operand(n, index, rank - s.dim, c.size, c.rw, s.block):
        raise Unsupported(f"{n.name}'s index does not span the split dim")
    return s


def _view_runtime_sizes(n: torch.fx.Node, s: Split, src: tuple[int, ...],
                        out: tuple[int, ...], rw: Rewrites, size: int) -> Split:
    """A view with run-time sizes carries only a split that stays the last dim (a linear's
    2-D output viewed back); the rewrite wraps the tuple in ``local_sizes``."""
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
    return _moved(s, j)


def _reads_batch(value: Any) -> bool:
    """Whether a size argument reads dim 0 of a graph input (torch.export's
    ``sym_size(input_ids, 0)``): the local batch size, which a gathered batch multiplies."""
    return (size_read(value) and len(value.args) == 2 and isinstance(value.args[1], int)
            and value.args[1] == 0 and isinstance(value.args[0], torch.fx.Node)
            and value.args[0].op == "placeholder")


def _note_batch(n: torch.fx.Node, j: int, first: Any, src: tuple[int, ...],
                out: tuple[int, ...], pos: ArgPos, rw: Rewrites) -> None:
    """A view or expand naming the batch in its first size: multiplied by tp when the batch
    is gathered (``rw.batch``)."""
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
    return _moved(s, b if s.dim == a else a if s.dim == b else s.dim)


def permute(c: Ctx, s: Split) -> Split:
    """The split dim goes where the permutation puts it."""
    n = c.node
    dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) \
        else n.args[1:]
    rank = len(dims)
    return _moved(s, [norm_dim(d, rank) for d in dims].index(s.dim))


def reshape(c: Ctx, s: Split) -> Split:
    """``view`` / ``reshape``: by ``_view`` (the heads' split and merge)."""
    return _view(c.node, s, c.rw, c.size)


def split_fused(c: Ctx, s: Split) -> Split:
    """``split`` / ``chunk`` along another dim keeps the split; along it, it must cut a column
    linear's own output in equal pieces (a fused projection), which becomes strided."""
    n, x = c.node, c.x
    chunk = _is_chunk(n)
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
    sizes = list(piece) if isinstance(piece, (list, tuple)) else None
    if sizes and len(set(sizes)) == 1:
        piece = sizes[0]  # split_with_sizes of equal pieces
    if src is not x or s.block or not isinstance(piece, (int, torch.fx.Node)) or (
            chunk and not isinstance(piece, int)):
        raise Unsupported(f"{n.name} splits the split dim of a value that is not a "
                          "column linear's output into equal pieces (a fused projection)")
    c.rw.strided[s.origin] = piece if isinstance(piece, int) and chunk else \
        whole // _size_of(piece, n)
    if sizes:
        c.rw.divide += [(n, (1, i)) for i in range(len(sizes))]
    elif not chunk:
        c.rw.divide.append((n, 1))
    return s


def _is_chunk(n: torch.fx.Node) -> bool:
    return n.target in ("chunk", torch.chunk, torch.ops.aten.chunk.default)


def unbind(c: Ctx, s: Split) -> Split:
    """``unbind`` along another dim: the pieces (taken by ``getitem``) keep the split."""
    dim = norm_dim(arg(c.node, 1, "dim", 0), len(shape(c.x) or ()))
    if dim == s.dim:
        raise Unsupported(f"{c.node.name} unbinds the split dim")
    return _moved(s, s.dim - (1 if dim < s.dim else 0))


def select(c: Ctx, s: Split) -> Split:
    """``select`` or ``squeeze`` of another dim: the split dim moves up when the dropped one
    is before it."""
    n = c.node
    rank = len(shape(c.x) or ())
    if n.target not in ("select", torch.select, torch.ops.aten.select.int):  # a squeeze
        dims = arg(n, 1, "dim", None)
        listed = dims if isinstance(dims, (list, tuple)) else [dims]
        src = shape(c.x) or ()
        gone = [d for d in range(rank) if src[d] == 1] if dims is None else \
            [norm_dim(d, rank) for d in listed if src[norm_dim(d, rank)] == 1]
    else:
        gone = [norm_dim(arg(n, 1, "dim", 0), rank)]
    if s.dim in gone:
        raise Unsupported(f"{n.name} drops the split dim")
    return _moved(s, s.dim - sum(1 for d in gone if d < s.dim))


def unsqueeze(c: Ctx, s: Split) -> Split:
    """A new dim before the split dim moves it by one."""
    at_dim = norm_dim(arg(c.node, 1, "dim", 0), len(shape(c.node) or ()))
    return _moved(s, s.dim + (1 if at_dim <= s.dim else 0))


def expand(c: Ctx, s: Split) -> Split:
    """By ``_expand`` (grouped-query attention's repeated kv heads)."""
    return _expand(c.node, s, c.rw)


def narrow(c: Ctx, s: Split) -> Split:
    """A slice along another dim keeps the split; along it, it must take one equal block of a
    column linear's output (fused projection cut by slices), which becomes strided."""
    n = c.node
    dim = norm_dim(arg(n, 1, "dim", 0), len(shape(c.x) or ()))
    if dim != s.dim:
        return s
    whole = (shape(c.x) or (0,) * (dim + 1))[dim]
    narrowing = n.target is torch.ops.aten.narrow.default
    start = arg(n, 2, "start", None) or 0
    end = start + arg(n, 3, "length", 0) if narrowing else arg(n, 3, "end", None)
    end = whole if end is None or (isinstance(end, int) and end > whole) else end
    step = 1 if narrowing else arg(n, 4, "step", 1)
    if (c.col_fused(s.origin) is not _fused_source(c, s) or s.block or step != 1
            or not isinstance(start, int) or not isinstance(end, int) or end <= start):
        raise Unsupported(f"{n.name} slices the split dim")
    length = end - start
    blocks = whole // length
    if whole % length or start % length or c.rw.strided.get(s.origin, blocks) != blocks:
        raise Unsupported(f"{n.name} slices the split dim into blocks of unequal size")
    c.rw.strided[s.origin] = blocks
    c.rw.divide += [(n, i) for i in (2, 3) if len(n.args) > i and isinstance(n.args[i], int)]
    return s


def _fused_source(c: Ctx, s: Split) -> Any:
    """The value a fused projection's pieces are cut from: the op's input, back through
    views that keep the last dim (Conv1D's 2-D output viewed back to ``(b, t, 3c)``)."""
    x, src = c.x, c.col_fused(s.origin)
    while (x is not src and isinstance(x, torch.fx.Node) and x.target in VIEWS
           and isinstance(x.args[0], torch.fx.Node) and x.args[0] in c.split
           and c.split[x.args[0]].origin == s.origin
           and (shape(x) or ())[-1:] == (shape(x.args[0]) or ())[-1:]):
        x = x.args[0]
    return x


def cat(c: Ctx) -> Split:
    """``cat`` / ``stack`` of values split alike; a replicated part with all of the split dim
    (a cache's past entries) is read as this rank's part, an empty 1-D part left as is."""
    n = c.node
    listed = n.args[0] if isinstance(n.args[0], (list, tuple)) else ()
    parts = [p for p in listed if isinstance(p, torch.fx.Node) and p in c.split]
    stack = n.target in STACKS
    rank = len(shape(n) or ())
    dim = norm_dim(arg(n, 1, "dim", 0), rank)
    if not parts or len({(c.split[p].dim, c.split[p].block) for p in parts}) != 1:
        raise Unsupported(f"{n.name} concatenates values split on different dims")
    first = c.split[parts[0]]
    d = first.dim + (1 if stack and dim <= first.dim else 0)
    if dim == d and not stack:
        raise Unsupported(f"{n.name} concatenates along the split dim")
    k = rank - d
    for p in listed:
        if p in parts or _empty(p):
            continue
        if stack or not (isinstance(p, torch.fx.Node)
                         and slice_operand(n, p, k, c.size, c.rw, first.block)):
            raise Unsupported(f"{n.name} concatenates split values with the replicated "
                              f"{getattr(p, 'name', p)}, which does not span the split dim")
    return Split(d, ",".join(sorted({c.split[p].origin for p in parts})), first.block)


def _empty(p: Any) -> bool:
    return shape(p) == (0,)


__all__ = ["cat", "expand", "flatten", "gather", "local_sizes", "narrow", "permute",
           "repeat", "reshape", "select", "split_fused", "transpose", "unbind", "unsqueeze"]
