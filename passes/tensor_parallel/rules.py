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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from passes import meta
from passes.tensor_parallel import graph as tp_graph


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


PASS_THROUGH_METHODS = frozenset({"contiguous", "float", "half", "to", "type_as", "clone"})
PASS_THROUGH_FUNCTIONS: frozenset[Any] = frozenset({
    torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default, torch.ops.aten.alias.default, torch.ops.aten.contiguous.default,
    torch.ops.aten._assert_tensor_metadata.default})
"""Ops whose output (if any) is split like their first input: casts, copies, and
torch.export's dtype assertions (which name no sizes)."""
SLICES: frozenset[Any] = frozenset({torch.ops.aten.slice.Tensor, torch.ops.aten.narrow.default})
CATS: frozenset[Any] = frozenset({torch.cat, torch.ops.aten.cat.default})
UNSQUEEZES: frozenset[Any] = frozenset({"unsqueeze", torch.unsqueeze,
                                        torch.ops.aten.unsqueeze.default})
EXPANDS: frozenset[Any] = frozenset({"expand", torch.ops.aten.expand.default})
SIZE_READS: frozenset[Any] = frozenset({torch.ops.aten.sym_size.int, "size"})
TRANSPOSES: frozenset[Any] = frozenset({"transpose", torch.transpose,
                                        torch.ops.aten.transpose.int})
VIEWS: frozenset[Any] = frozenset({"view", "reshape", torch.reshape,
                                   torch.ops.aten.view.default,
                                   torch.ops.aten.reshape.default})
SPLITS: frozenset[Any] = frozenset({"split", torch.split, torch.ops.aten.split.Tensor})
SDPA: frozenset[Any] = frozenset({F.scaled_dot_product_attention,
                                  torch.ops.aten.scaled_dot_product_attention.default})
SOFTMAX: frozenset[Any] = frozenset({"softmax", F.softmax, torch.softmax,
                                     torch.ops.aten._softmax.default, torch.ops.aten.softmax.int})
MATMUL: frozenset[Any] = frozenset({"matmul", torch.matmul, operator.matmul, torch.bmm,
                                    torch.ops.aten.matmul.default, torch.ops.aten.bmm.default})


def arg(n: torch.fx.Node, i: int, name: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def elementwise_out(n: torch.fx.Node, split: dict[torch.fx.Node, Split],
                    rw: Rewrites | None = None) -> Split:
    """Broadcasting: split inputs aligned on one dim (counted from the end); replicated
    tensor inputs must have size 1 there (RoPE's cos/sin, masks) or not reach it. One
    with the output's batch on dim 0 is noted in ``rw.gather`` (``_batched_operand``)."""
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
            _batched_operand(n, a, out, rw)
    return Split(len(out) - k, ",".join(sorted(origins)))


def _batched_operand(n: torch.fx.Node, a: torch.fx.Node, out: tuple[int, ...],
                     rw: Rewrites) -> None:
    """Record a replicated operand that has the batch on dim 0 (an attention mask of
    shape (b, 1, t, t)): with ``prescaled_batch`` false the split chain runs on the tp
    group's gathered batch, so the operand is gathered too. A batch of one cannot be told
    from a broadcast: such an operand is gathered as well (tp equal copies of a constant
    broadcast the same way; a per-example one must be gathered)."""
    s = shape(a)
    if s is not None and len(s) == len(out) and s[0] == out[0]:
        rw.gather.append((n, a))


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


def _slice_operand(n: torch.fx.Node, operand: Any, k: int, size: int, rw: Rewrites) -> bool:
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
    _batched_operand(n, operand, out, rw)
    return True


def size_read(n: Any) -> bool:
    return isinstance(n, torch.fx.Node) and n.target in SIZE_READS


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


def propagate(n: torch.fx.Node, split: dict[torch.fx.Node, Split], rw: Rewrites,
              size: int, col_fused: Callable[[str], torch.fx.Node | None]) -> Split | None:
    """The split of ``n``'s output given its inputs' (some split), or ``Unsupported``."""
    t = n.target
    x = n.args[0] if n.args else None
    s = split.get(x) if isinstance(x, torch.fx.Node) else None
    if s is not None and ((n.op == "call_method" and t in PASS_THROUGH_METHODS)
                          or (n.op == "call_function" and t in PASS_THROUGH_FUNCTIONS)):
        return s
    if t in TRANSPOSES and s is not None:
        rank = len(shape(x) or ())
        a, b = norm_dim(n.args[1], rank), norm_dim(n.args[2], rank)
        return Split(b if s.dim == a else a if s.dim == b else s.dim, s.origin)
    if t in ("permute", torch.permute) and s is not None:
        dims = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) \
            else n.args[1:]
        rank = len(dims)
        return Split([norm_dim(d, rank) for d in dims].index(s.dim), s.origin)
    if t in VIEWS and s is not None:
        return _view(n, s, rw, size)
    if t in SOFTMAX and s is not None:
        dim = arg(n, 1, "dim")
        if norm_dim(dim, len(shape(x) or ())) == s.dim:
            raise Unsupported(f"{n.name} normalises over the split dim")
        return s
    if t in SPLITS and s is not None:
        dim = norm_dim(arg(n, 2, "dim", 0), len(shape(x) or ()))
        if dim != s.dim:
            return s
        whole, piece = (shape(x) or (0,) * (dim + 1))[dim], n.args[1]
        src = col_fused(s.origin)
        while (x is not src and isinstance(x, torch.fx.Node) and x.target in VIEWS
               and isinstance(x.args[0], torch.fx.Node) and x.args[0] in split
               and split[x.args[0]].origin == s.origin
               and dim == len(shape(x) or ()) - 1
               and (shape(x) or ())[-1:] == (shape(x.args[0]) or ())[-1:]):
            x = x.args[0]  # Conv1D: the addmm's 2-D output viewed back to (b, t, 3c)
        if src is not x or not isinstance(piece, (int, torch.fx.Node)):
            raise Unsupported(f"{n.name} splits the split dim of a value that is not a "
                              "column linear's output (a fused projection)")
        rw.strided[s.origin] = whole // _size_of(piece, n)
        rw.divide.append((n, 1))
        return s
    if n.op == "call_function" and t is operator.getitem and s is not None:
        return s
    if t in UNSQUEEZES and s is not None:
        at_dim = norm_dim(arg(n, 1, "dim", 0), len(shape(n) or ()))
        return Split(s.dim + (1 if at_dim <= s.dim else 0), s.origin)
    if t in EXPANDS and s is not None:
        return _expand(n, s, rw)
    if t in SLICES and s is not None:
        if norm_dim(arg(n, 1, "dim", 0), len(shape(x) or ())) == s.dim:
            raise Unsupported(f"{n.name} slices the split dim")
        return s
    if t in CATS:
        listed = n.args[0] if isinstance(n.args[0], (list, tuple)) else ()
        parts = [p for p in listed if isinstance(p, torch.fx.Node) and p in split]
        dim = norm_dim(arg(n, 1, "dim", 0), len(shape(n) or ()))
        if not parts or len(parts) != len(listed) or len({split[p].dim for p in parts}) != 1:
            raise Unsupported(f"{n.name} concatenates split and replicated values")
        if dim == split[parts[0]].dim:
            raise Unsupported(f"{n.name} concatenates along the split dim")
        return Split(split[parts[0]].dim, ",".join(sorted({split[p].origin for p in parts})))
    if t in SDPA:
        qkv: list[Any] = list(n.args[:3])
        k_heads = len(shape(qkv[0]) or ()) - split[qkv[0]].dim if qkv[0] in split else 0
        for kv in qkv[1:]:  # GQA with kv heads tp does not divide: k, v replicated
            if kv not in split and k_heads > 2:
                _slice_operand(n, kv, k_heads, size, rw)
        if not all(a in split or (a, n) in rw.slices for a in qkv) or not all(
                split[a].dim == split[qkv[0]].dim for a in qkv if a in split):
            raise Unsupported(f"{n.name} attends over q, k, v not all split by heads")
        if split[qkv[0]].dim >= len(shape(qkv[0]) or ()) - 2:
            raise Unsupported(f"{n.name}'s q is split along its sequence or head features")
        mask = arg(n, 3, "attn_mask")
        if isinstance(mask, torch.fx.Node) and mask not in split:
            ms = shape(mask)
            k = len(shape(qkv[0]) or ()) - split[qkv[0]].dim
            if ms is None or (len(ms) >= k and ms[len(ms) - k] != 1):
                raise Unsupported(f"{n.name}'s mask {mask.name} is not broadcast over heads")
            _batched_operand(n, mask, shape(qkv[0]) or (), rw)
        return split[qkv[0]]
    if t in MATMUL:
        lhs: Any = n.args[0]
        rhs: Any = n.args[1]
        sa, sb = split.get(lhs), split.get(rhs)
        ra = len(shape(lhs) or ())
        if sa and sb and ra - sa.dim == len(shape(rhs) or ()) - sb.dim and ra - sa.dim > 2:
            return Split(len(shape(n) or ()) - (ra - sa.dim), sa.origin)
        one = sa or sb
        if one is not None and (sa is None or sb is None):
            mine, other = (lhs, rhs) if sa else (rhs, lhs)
            k = len(shape(mine) or ()) - one.dim
            if k > 2 and _slice_operand(n, other, k, size, rw):
                return Split(len(shape(n) or ()) - k, one.origin)
        raise Unsupported(f"{n.name} ({t}) multiplies along a split dim")
    return None


ELEMENTWISE_MODULES: tuple[type, ...] = (
    nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU)
ELEMENTWISE_FUNCTIONS: frozenset[Any] = frozenset({
    F.gelu, F.relu, F.silu, F.dropout, F.leaky_relu, torch.relu, torch.tanh, torch.sigmoid,
    torch.mul, torch.add, torch.pow, operator.mul, operator.add, operator.sub,
    operator.truediv, operator.pow,
    torch.ops.aten.gelu.default, torch.ops.aten.silu.default, torch.ops.aten.relu.default,
    torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor, torch.ops.aten.tanh.default,
    torch.ops.aten.sigmoid.default, torch.ops.aten.dropout.default,
    torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.sub.Tensor, torch.ops.aten.div.Tensor,
    torch.ops.aten.neg.default, torch.neg, operator.neg,
})
ELEMENTWISE_METHODS: frozenset[str] = frozenset(
    {"relu", "sigmoid", "tanh", "mul", "add", "sub", "div", "pow", "__mul__", "__add__"})


def elementwise(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(tp_graph.attr(gm, str(n.target)), ELEMENTWISE_MODULES)
    if n.op == "call_function":
        return n.target in ELEMENTWISE_FUNCTIONS
    return n.op == "call_method" and n.target in ELEMENTWISE_METHODS


def rule(gm: torch.fx.GraphModule, n: torch.fx.Node, split: dict[torch.fx.Node, Split],
          rw: Rewrites, size: int, col: Callable[[str], torch.fx.Node | None]) -> Split | None:
    if elementwise(gm, n):
        ins = [a for a in n.all_input_nodes if a in split]
        if any(shape(a) is None for a in n.all_input_nodes):
            if len(ins) != len(n.all_input_nodes) or len({split[a].dim for a in ins}) != 1:
                raise Unsupported(f"{n.name} ({n.target}) mixes a feature-split "
                                  "value with a replicated tensor")
            origins = sorted({o for a in ins for o in split[a].origin.split(",")})
            return Split(split[ins[0]].dim, ",".join(origins))
        return elementwise_out(n, split, rw)
    return propagate(n, split, rw, size, col)
