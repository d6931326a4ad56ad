"""Vocab-parallel cross entropy: the loss of a tied LM head's logits without gathering them.

The logits are a language model's largest activation; gathering them to reduce them to
one number per token wastes link and memory. Fused only where exact (views and float
casts between head and loss, no class weights or label smoothing).
See docs/tensor_parallel.md, 'The rewrite'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.nn import functional as F

from passes import meta
from passes.tensor_parallel import collectives, costs, graph
from passes.tensor_parallel.plan import ShardSpec

CROSS_ENTROPY: frozenset[Any] = frozenset({F.cross_entropy,
                                           torch.ops.aten.cross_entropy_loss.default})
RESHAPES = frozenset({"flatten", "view", "reshape", "contiguous"})
aten = torch.ops.aten
ATEN_RESHAPES: dict[Any, str] = {  # torch.export's reshapes, as the method they are
    aten.view.default: "view", aten.reshape.default: "reshape", aten._unsafe_view.default:
    "view", aten.contiguous.default: "contiguous", aten.flatten.using_ints: "flatten"}
REDUCTIONS = ("none", "mean", "sum")  # aten's reduction enum order


class _VocabCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, vocab: int,
                ignore_index: int) -> torch.Tensor:
        n = logits.shape[-1]
        cols = torch.arange(start, start + n, device=logits.device)
        x = logits.masked_fill(cols >= vocab, float("-inf"))  # padding columns
        top = collectives.group_all_reduce(x.detach().max(-1).values, "max")
        exp = (x - top.unsqueeze(-1)).exp()
        total = collectives.group_all_reduce(exp.sum(-1))
        local = target - start
        owned = (local >= 0) & (local < n)
        index = local.clamp(0, n - 1).unsqueeze(-1)
        picked = torch.where(owned, (x - top.unsqueeze(-1)).gather(-1, index).squeeze(-1),
                             torch.zeros((), dtype=x.dtype, device=x.device))
        picked = collectives.group_all_reduce(picked)
        ignored = target == ignore_index
        loss = (total.log() - picked).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, owned & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, index, hit, ignored = ctx.saved_tensors
        grad = softmax.scatter_add(-1, index, -hit.unsqueeze(-1).to(softmax.dtype))
        return grad * g.masked_fill(ignored, 0.0).unsqueeze(-1), None, None, None, None


def tp_vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int,
                           vocab: int, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross entropy of ``[tokens, n]`` logits that are this rank's vocabulary
    columns ``[start, start + n)`` (columns >= ``vocab`` are padding), reduced over the
    tp group; ignored tokens give 0. Without a group: over these columns alone (``start``
    0 and every column: ``F.cross_entropy(..., reduction="none")``)."""
    out: torch.Tensor = _VocabCrossEntropy.apply(logits, target, start, vocab, ignore_index)
    return out


def token_loss(losses: torch.Tensor, target: torch.Tensor, reduction: str,
               ignore_index: int = -100) -> torch.Tensor:
    """Per-token losses reduced as ``F.cross_entropy`` does: the mean over the tokens not
    ignored, the sum, or none."""
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()


def _named(names: tuple[str, ...], n: torch.fx.Node) -> dict[str, Any]:
    """``n``'s arguments by parameter name."""
    out: dict[str, Any] = dict(zip(names, n.args))
    out.update(n.kwargs)
    return out


def _options(ce: torch.fx.Node) -> tuple[torch.fx.Node, Any, int, str] | None:
    """(logits, target, ignore_index, reduction) of a cross-entropy call the fused loss
    computes exactly, or None."""
    names: tuple[str, ...]
    if ce.target is F.cross_entropy:
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                 "reduction", "label_smoothing")
        a = _named(names, ce)
        if a.get("weight") is not None or a.get("size_average") is not None or \
                a.get("reduce") is not None or a.get("label_smoothing", 0.0):
            return None
        reduction = a.get("reduction", "mean")
    else:  # aten.cross_entropy_loss(input, target, weight, reduction, ignore_index, smoothing)
        names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
        a = _named(names, ce)
        if a.get("weight") is not None or a.get("label_smoothing", 0.0):
            return None
        reduction = REDUCTIONS[int(a.get("reduction", 1))]
    logits, target = a.get("input"), a.get("target")
    if not isinstance(logits, torch.fx.Node) or reduction not in REDUCTIONS:
        return None
    shapes = [getattr(meta.TENSOR.get(n), "shape", None) if isinstance(n, torch.fx.Node)
              else None for n in (logits, target)]
    if shapes[0] is None or len(shapes[0]) != 2 or shapes[1] is None or len(shapes[1]) != 1:
        return None
    return logits, target, int(a.get("ignore_index", -100)), str(reduction)


def _float_cast(n: torch.fx.Node) -> bool:
    """``n`` only casts its input to a floating dtype (HF's ``logits.float()`` upcast, as
    ``Tensor.float`` / ``.to(dtype)`` or torch.export's ``aten.to.dtype`` /
    ``aten._to_copy``): element-wise, so it works on this rank's columns alike."""
    if n.op == "call_method" and n.target == "float":
        return len(n.args) == 1 and not n.kwargs
    if (n.op, n.target) in (("call_method", "to"), ("call_function", aten.to.dtype)):
        dtype, rest = (n.args[1] if len(n.args) > 1 else None), n.args[2:]
        return isinstance(dtype, torch.dtype) and dtype.is_floating_point and \
            not any(rest) and not any(n.kwargs.values())
    if n.target is aten._to_copy.default:
        dtype = n.kwargs.get("dtype")
        return len(n.args) == 1 and isinstance(dtype, torch.dtype) and \
            dtype.is_floating_point and set(n.kwargs) <= {"dtype", "layout"} and \
            n.kwargs.get("layout", torch.strided) == torch.strided
    return False


def uncast(n: torch.fx.Node) -> torch.fx.Node:
    """``n`` without its float casts: the node they cast (a linear whose logits HF upcasts
    before the loss is the one ``sweep.sweep`` retries as lone)."""
    while _float_cast(n) and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    return n


def _check_only(n: torch.fx.Node) -> bool:
    """``n`` is torch.export's dtype / device / layout assertion (no shape), which this
    rank's columns pass as the gathered logits do."""
    return n.target is aten._assert_tensor_metadata.default and len(n.args) == 1 and \
        n.kwargs.get("size") is None and n.kwargs.get("stride") is None


def _local_reshape(n: torch.fx.Node, vocab: int) -> dict[int, Any] | None:
    """The argument edits (position -> new value, ``vocab`` still to be replaced by the
    local width) that make the reshape or float cast ``n`` work on this rank's columns,
    or None when it would mix the vocabulary dim with others."""
    if _float_cast(n):
        return {}
    method = n.target if n.op == "call_method" else ATEN_RESHAPES.get(n.target) \
        if n.op == "call_function" else None
    if method not in RESHAPES or not n.args:
        return None
    if method == "contiguous":
        return {}
    shape = getattr(meta.TENSOR.get(n.args[0]), "shape", None)  # type: ignore[arg-type]
    if not shape:
        return None
    if method == "flatten":
        end = n.args[2] if len(n.args) > 2 else n.kwargs.get("end_dim", -1)
        return {} if isinstance(end, int) and end % len(shape) != len(shape) - 1 else None
    if n.kwargs:
        return None
    if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)):
        sizes = tuple(n.args[1])
        return {1: sizes} if sizes and sizes[-1] == vocab else None
    return {len(n.args) - 1: vocab} if n.args[-1] == vocab else None


def _chain(head: torch.fx.Node, gather: bool, vocab: int
           ) -> tuple[list[torch.fx.Node], list[torch.fx.Node], torch.fx.Node] | None:
    """(collectives, reshapes and casts, cross entropy) from a vocab-parallel head to its
    loss; metadata assertions (``_check_only``) on the way are not uses."""
    comms, cur = [], head
    for fn in (collectives.tp_gather_last,) + ((collectives.tp_split_batch,)
                                               if gather else ()):
        users = [u for u in cur.users if not _check_only(u)]
        if len(users) != 1 or users[0].target is not fn:
            return None
        cur = users[0]
        comms.append(cur)
    reshapes: list[torch.fx.Node] = []
    while len(users := [u for u in cur.users if not _check_only(u)]) == 1:
        user = users[0]
        if user.op == "call_function" and user.target in CROSS_ENTROPY:
            return comms, reshapes, user
        if _local_reshape(user, vocab) is None:
            return None
        reshapes.append(user)
        cur = user
    return None


def _localise(n: torch.fx.Node, vocab: int, n_local: int, grow: int) -> None:
    """The reshape ``n`` sized for this rank's ``n_local`` columns; its shape meta too
    (``grow``: the batch, leading, gathered over the tp group)."""
    for pos, value in (_local_reshape(n, vocab) or {}).items():
        n.update_arg(pos, (*value[:-1], n_local) if isinstance(value, tuple) else n_local)
    info = meta.TENSOR.get(n)
    if info is not None and info.shape:
        shape = (info.shape[0] * grow, *info.shape[1:-1], n_local)
        meta.TENSOR.set(n, dataclasses.replace(
            info, shape=shape, nbytes=info.nbytes * grow * n_local // max(info.shape[-1], 1)))


def vocab_heads(gm: torch.fx.GraphModule, vocab: Sequence[ShardSpec], rank: int
                ) -> dict[str, tuple[int, int]]:
    """The rewritten LM heads (lone linears) whose weight is a vocab-parallel embedding's
    shard in ``vocab``: node name -> (this rank's first column, vocabulary size)."""
    shards = {id(graph.attr(gm, s.name)): s for s in vocab}
    heads = {}
    for n in gm.graph.nodes:
        w = n.args[1] if meta.TP.get(n) == "lone" and len(n.args) > 1 else None
        spec = shards.get(id(graph.attr(gm, str(w.target)))) \
            if isinstance(w, torch.fx.Node) and w.op == "get_attr" else None
        if spec is not None:
            heads[n.name] = (rank * spec.local_shape[0], spec.full_shape[0])
    return heads


def fuse(gm: torch.fx.GraphModule, size: int, gather: bool,
         heads: Mapping[str, tuple[int, int]]) -> list[str]:
    """Fuse every vocab-parallel head's gather and cross entropy (module docstring).
    ``heads``: node name of a rewritten tied LM head -> (its first column, vocabulary).
    Returns the fused heads' names."""
    g, fused = gm.graph, []
    by_name = {n.name: n for n in g.nodes}
    for name, (start, vocab) in heads.items():
        head = by_name[name]
        found = _chain(head, gather, vocab)
        opts = None if found is None else _options(found[2])
        if found is None or opts is None:
            continue
        comms, reshapes, ce = found
        logits, target, ignore_index, reduction = opts
        weight = head.args[1]
        assert isinstance(weight, torch.fx.Node)
        n_local = int(graph.attr(gm, str(weight.target)).shape[0])
        for r in reshapes:  # before the collectives go: the edits read the input's shape
            _localise(r, vocab, n_local, size if gather else 1)
        (reshapes[0] if reshapes else ce).replace_input_with(comms[-1], head)
        for c in reversed(comms):
            for check in list(c.users):  # dtype asserts: the local columns' dtype is theirs
                check.replace_input_with(c, head)
            g.erase_node(c)
        with g.inserting_before(ce):
            t = target
            if gather:
                t = graph.insert(g, collectives.tp_gather_batch, (target,), ce, size)
            per = graph.insert(g, tp_vocab_cross_entropy,
                               (logits, t, start, vocab, ignore_index), ce, size)
            info = meta.TENSOR.get(logits)
            if info is not None and info.shape:
                meta.TENSOR.set(per, dataclasses.replace(info, shape=info.shape[:1],
                                                         nbytes=info.shape[0] * 4))
            cost = meta.COST.get(ce)
            if cost is not None:
                meta.COST.set(per, costs.divide(cost, size))
            if gather:
                per = graph.insert(g, collectives.tp_split_batch, (per,), ce, size)
            out = graph.insert(g, token_loss, (per, target, reduction, ignore_index),
                               ce, size)
        meta.TENSOR.set(out, meta.TENSOR.get(ce))
        ce.replace_all_uses_with(out)
        g.erase_node(ce)
        fused.append(name)
    return fused


__all__ = ["fuse", "token_loss", "tp_vocab_cross_entropy", "uncast", "vocab_heads"]
