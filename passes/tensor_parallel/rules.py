"""Which sharding rule each op gets: the table ``RULES`` from op targets to rules.

A rule takes a ``Ctx`` (the node and the splits of its inputs) and returns the split of
its output, None when it does not apply, or raises ``Unsupported`` with the reason
(``propagation``). Shape ops' rules are in ``reshapes``; attention's products and the
element-wise ops are here. ``rule`` looks a node's rule up once and applies it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx

from passes.tensor_parallel import reshapes
from passes.tensor_parallel.ops import (
    CATS,
    ELEMENTWISE_FUNCTIONS,
    ELEMENTWISE_METHODS,
    EXPANDS,
    MATMUL,
    PASS_THROUGH_FUNCTIONS,
    PASS_THROUGH_METHODS,
    PERMUTES,
    SDPA,
    SLICES,
    SOFTMAX,
    SPLITS,
    TRANSPOSES,
    UNSQUEEZES,
    VIEWS,
    elementwise,
)
from passes.tensor_parallel.propagation import (
    Ctx,
    Rewrites,
    Rule,
    Split,
    Unsupported,
    arg,
    batched_operand,
    elementwise_out,
    norm_dim,
    shape,
    slice_operand,
)


def _first_split(fn: Callable[[Ctx, Split], Split]) -> Rule:
    """A rule of the first argument's split: no split there, no rule (another input is
    the split one, which the op does not carry)."""
    def on_first(c: Ctx) -> Split | None:
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
    if split[qkv[0]].dim >= len(shape(qkv[0]) or ()) - 2:
        raise Unsupported(f"{n.name}'s q is split along its sequence or head features")
    mask = arg(n, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node) and mask not in split:
        ms = shape(mask)
        k = len(shape(qkv[0]) or ()) - split[qkv[0]].dim
        if ms is None or (len(ms) >= k and ms[len(ms) - k] != 1):
            raise Unsupported(f"{n.name}'s mask {mask.name} is not broadcast over heads")
        batched_operand(n, mask, shape(qkv[0]) or (), c.rw)
    return split[qkv[0]]


def _matmul(c: Ctx) -> Split:
    """A batched product over a head dim both sides share (``q @ k^T``, ``p @ v``); one
    side replicated is cut to this rank's heads."""
    n = c.node
    lhs: Any = n.args[0]
    rhs: Any = n.args[1]
    sa, sb = c.split.get(lhs), c.split.get(rhs)
    ra = len(shape(lhs) or ())
    if sa and sb and ra - sa.dim == len(shape(rhs) or ()) - sb.dim and ra - sa.dim > 2:
        return Split(len(shape(n) or ()) - (ra - sa.dim), sa.origin)
    one = sa or sb
    if one is not None and (sa is None or sb is None):
        mine, other = (lhs, rhs) if sa else (rhs, lhs)
        k = len(shape(mine) or ()) - one.dim
        if k > 2 and slice_operand(n, other, k, c.size, c.rw):
            return Split(len(shape(n) or ()) - k, one.origin)
    raise Unsupported(f"{n.name} ({n.target}) multiplies along a split dim")


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
    return elementwise_out(n, split, c.rw)


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
    (SOFTMAX,                                            _first_split(_softmax)),
    (SDPA,                                               _sdpa),
    (MATMUL,                                             _matmul),
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
         rw: Rewrites, size: int, col: Callable[[str], torch.fx.Node | None]) -> Split | None:
    """The split of ``n``'s output by its rule (None: no rule covers ``n``), or
    ``Unsupported``."""
    fn = rule_for(gm, n)
    return None if fn is None else fn(Ctx(gm, n, split, rw, size, col))


__all__ = ["RULES", "rule", "rule_for"]
