"""Which sharding rule each op gets: the table ``RULES`` from op targets to rules.

A rule returns its output's split, None when it does not apply, or raises
``Unsupported``; shape ops' rules are in ``reshapes``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx

from passes.tensor_parallel import reshapes
from passes.tensor_parallel.ops import (
    BADDBMM,
    CATS,
    ELEMENTWISE_FUNCTIONS,
    ELEMENTWISE_METHODS,
    EXPANDS,
    FLATTENS,
    GATHERS,
    MATMUL,
    PASS_THROUGH_FUNCTIONS,
    PASS_THROUGH_METHODS,
    PERMUTES,
    REDUCTIONS,
    REPEATS,
    SDPA,
    SELECTS,
    SLICES,
    SOFTMAX,
    SPLITS,
    STACKS,
    TRANSPOSES,
    UNBINDS,
    UNSQUEEZES,
    VIEWS,
    elementwise,
)
from passes.tensor_parallel.propagation import (
    REPLICATED,
    Ctx,
    Replicated,
    Rewrites,
    Rule,
    Split,
    Unsupported,
    arg,
    batched_operand,
    copy_operand,
    elementwise_out,
    norm_dim,
    shape,
    slice_operand,
)


def _first_split(fn: Callable[[Ctx, Split], Split | Replicated]) -> Rule:
    """A rule of the first argument's split: no split there, no rule (another input is
    the split one, which the op does not carry)."""
    def on_first(c: Ctx) -> Split | Replicated | None:
        s = c.s
        return None if s is None else fn(c, s)
    on_first.__name__ = fn.__name__
    on_first.__doc__ = fn.__doc__
    return on_first


def _pass_through(c: Ctx, s: Split) -> Split:
    """Casts, copies, ``getitem`` of a split tuple: the output is split like the input."""
    return s


def _softmax(c: Ctx, s: Split) -> Split:
    """Softmax over another dim than the split one (attention scores split by heads)."""
    if norm_dim(arg(c.node, 1, "dim"), len(shape(c.x) or ())) == s.dim:
        raise Unsupported(f"{c.node.name} normalises over the split dim")
    return s


def _reduce(c: Ctx, s: Split) -> Split | Replicated:
    """A sum or mean over other dims keeps the split (a per-head RMSNorm: Qwen3's q/k
    norms); over the split dim each rank's is a part, completed by an all-reduce
    (``Rewrites.partial``: a mean's parts are of equal size, so it is their mean) and the
    output is replicated (OLMo-2's full-width q/k norms)."""
    n = c.node
    rank = len(shape(c.x) or ())
    dims = arg(n, 1, "dim", None)
    listed = list(range(rank)) if dims is None or dims == [] else [
        norm_dim(d, rank) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    keep = bool(arg(n, 2, "keepdim", False))
    if s.dim not in listed:
        return dataclasses.replace(s, dim=s.dim if keep else s.dim - sum(
            1 for d in listed if d < s.dim))
    mean = n.target in ("mean", torch.mean, torch.ops.aten.mean.dim)
    c.rw.partial[n] = 1.0 / c.size if mean else 1.0
    return REPLICATED


def _sdpa(c: Ctx) -> Split:
    """Attention over q, k, v split by heads (a replicated k or v of grouped-query
    attention cut to this rank's heads); a mask broadcast over the heads."""
    n, split = c.node, c.split
    qkv: list[Any] = list(n.args[:3])
    k_heads = len(shape(qkv[0]) or ()) - split[qkv[0]].dim if qkv[0] in split else 0
    for kv in qkv[1:]:  # GQA with kv heads tp does not divide: k, v replicated
        if kv not in split and k_heads > 2:
            slice_operand(n, kv, k_heads, c.size, c.rw)
    if not all(a in split or (a, n) in c.rw.slices for a in qkv) or not all(
            split[a].dim == split[qkv[0]].dim for a in qkv if a in split):
        raise Unsupported(f"{n.name} attends over q, k, v not all split by heads")
    if split[qkv[0]].dim >= len(shape(qkv[0]) or ()) - 2 or split[qkv[0]].block:
        raise Unsupported(f"{n.name}'s q is split along its sequence or head features")
    mask = arg(n, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node) and mask not in split:
        ms = shape(mask)
        k = len(shape(qkv[0]) or ()) - split[qkv[0]].dim
        if ms is None or (len(ms) >= k and ms[len(ms) - k] != 1):
            raise Unsupported(f"{n.name}'s mask {mask.name} is not broadcast over heads")
        batched_operand(n, mask, shape(qkv[0]) or (), c.rw)
        copy_operand(n, mask, c.rw)
    return split[qkv[0]]


def _matmul(c: Ctx) -> Split:
    """A batched product over a head dim both sides share (``q @ k^T``, ``p @ v``); one
    side replicated is cut to this rank's heads."""
    return _product(c, c.node.args[0], c.node.args[1])


def _product(c: Ctx, lhs: Any, rhs: Any) -> Split:
    n = c.node
    sa, sb = c.split.get(lhs), c.split.get(rhs)
    ra = len(shape(lhs) or ())
    if sa and sb and ra - sa.dim == len(shape(rhs) or ()) - sb.dim and ra - sa.dim > 2 \
            and sa.block == sb.block:
        return Split(len(shape(n) or ()) - (ra - sa.dim), sa.origin, sa.block)
    one = sa or sb
    if one is not None and (sa is None or sb is None):
        mine, other = (lhs, rhs) if sa else (rhs, lhs)
        k = len(shape(mine) or ()) - one.dim
        if k > 2 and slice_operand(n, other, k, c.size, c.rw, one.block):
            return Split(len(shape(n) or ()) - k, one.origin, one.block)
    raise Unsupported(f"{n.name} ({n.target}) multiplies along a split dim")


def _baddbmm(c: Ctx) -> Split:
    """``beta * input + alpha * (batch1 @ batch2)`` (BLOOM's ALiBi scores on
    ``(b * heads, t, t)``): the product's rule, and the replicated bias cut to this rank's
    heads of every example like an element-wise operand."""
    n = c.node
    bias, lhs, rhs = n.args[0], n.args[1], n.args[2]
    if lhs not in c.split and rhs not in c.split:
        raise Unsupported(f"{n.name} adds a split bias to a replicated product")
    out = _product(c, lhs, rhs)
    k = len(shape(n) or ()) - out.dim
    if isinstance(bias, torch.fx.Node) and bias in c.split:
        if (len(shape(bias) or ()) - c.split[bias].dim, c.split[bias].block) != (k, out.block):
            raise Unsupported(f"{n.name}'s bias is split unlike its product")
    elif isinstance(bias, torch.fx.Node) and not slice_operand(n, bias, k, c.size, c.rw,
                                                                out.block):
        raise Unsupported(f"{n.name}'s bias {bias.name} does not span the split dim")
    return out


def _elementwise(c: Ctx) -> Split:
    """Element-wise ops (activations, SwiGLU's ``gate * up``, residual adds inside a
    pair): broadcasting by ``elementwise_out``; without static shapes only inputs all
    split alike."""
    n, split = c.node, c.split
    ins = [a for a in n.all_input_nodes if a in split]
    if any(shape(a) is None for a in n.all_input_nodes):
        if len(ins) != len(n.all_input_nodes) or len({split[a].dim for a in ins}) != 1:
            raise Unsupported(f"{n.name} ({n.target}) mixes a feature-split "
                              "value with a replicated tensor")
        origins = sorted({o for a in ins for o in split[a].origin.split(",")})
        return Split(split[ins[0]].dim, ",".join(origins))
    return elementwise_out(n, split, c.rw, c.size)


def _table(*rows: tuple[Collection[Any], Rule]) -> dict[Any, Rule]:
    """``{target: rule}`` from (targets, rule) rows. A target in two rows is an error:
    the if-chain this table replaced was first-match, and no target needed that."""
    out: dict[Any, Rule] = {}
    for targets, fn in rows:
        for t in targets:
            if t in out:
                raise ValueError(f"{t!r} has two sharding rules")
            out[t] = fn
    return out


RULES: dict[Any, Rule] = _table(
    # op family (ops.py)                                 rule
    (ELEMENTWISE_FUNCTIONS | ELEMENTWISE_METHODS,        _elementwise),
    (PASS_THROUGH_METHODS | PASS_THROUGH_FUNCTIONS,      _first_split(_pass_through)),
    ({operator.getitem},                                 _first_split(_pass_through)),
    (TRANSPOSES,                                         _first_split(reshapes.transpose)),
    (PERMUTES,                                           _first_split(reshapes.permute)),
    (VIEWS,                                              _first_split(reshapes.reshape)),
    (SPLITS,                                             _first_split(reshapes.split_fused)),
    (UNSQUEEZES,                                         _first_split(reshapes.unsqueeze)),
    (EXPANDS,                                            _first_split(reshapes.expand)),
    (SLICES,                                             _first_split(reshapes.narrow)),
    (CATS,                                               reshapes.cat),
    (FLATTENS,                                           _first_split(reshapes.flatten)),
    (REPEATS,                                            _first_split(reshapes.repeat)),
    (GATHERS,                                            _first_split(reshapes.gather)),
    (UNBINDS,                                            _first_split(reshapes.unbind)),
    (SELECTS,                                            _first_split(reshapes.select)),
    (STACKS,                                             reshapes.cat),
    (SOFTMAX,                                            _first_split(_softmax)),
    (REDUCTIONS,                                         _first_split(_reduce)),
    (SDPA,                                               _sdpa),
    (MATMUL,                                             _matmul),
    (BADDBMM,                                            _baddbmm),
)
"""The rule of each op target: ``call_function`` targets by the function or aten
overload, ``call_method`` targets by the method name; ``call_module`` nodes of the
element-wise module types (``ops.ELEMENTWISE_MODULES``) take ``_elementwise``. Rules
wrapped in ``_first_split`` apply only when the op's first argument is the split value
(else no rule: the sweep names the op). ``size()`` reads never reach here (``sweep``
keeps them: the sizes are already local)."""


def rule_for(gm: torch.fx.GraphModule, n: torch.fx.Node) -> Rule | None:
    """The rule for ``n``, looked up once: by module type for ``call_module``, by target
    in ``RULES`` for functions and methods."""
    if n.op == "call_module":
        return _elementwise if elementwise(gm, n) else None
    if n.op in ("call_function", "call_method"):
        return RULES.get(n.target)
    return None


def rule(gm: torch.fx.GraphModule, n: torch.fx.Node, split: dict[torch.fx.Node, Split],
         rw: Rewrites, size: int, col: Callable[[str], torch.fx.Node | None]
         ) -> Split | Replicated | None:
    """The split of ``n``'s output by its rule (None: no rule covers ``n``), or
    ``Unsupported``."""
    fn = rule_for(gm, n)
    return None if fn is None else fn(Ctx(gm, n, split, rw, size, col))


__all__ = ["RULES", "rule", "rule_for"]
