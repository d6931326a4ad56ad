"""A loss computed inside the model, under context parallelism: over every rank's tokens.

On a chunk, a cross-entropy's mean is over the rank's own tokens. ``cp_loss`` makes it
one process's: each rank's sum of token losses and its count of counted tokens (their
class weights, if any) are summed over cp, and the loss is one over the other. The
targets are computed whole (Hugging Face shifts the labels inside the loss: a pad and a
slice of the whole sequence, so the chunks' boundaries get their next tokens) and cut to
the local tokens where the loss reads them, before they are flattened (``target_cut``).
transformers 4.x shifts the other way (the scores' last position sliced off, the labels'
first): ``pad_shifted_labels`` rewrites that into the padded labels first, the same loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from passes.context_parallel import collectives
from passes.context_parallel.dims import seq_dims, val_of

aten = torch.ops.aten
LOSSES = frozenset({aten.cross_entropy_loss.default, aten.nll_loss.default,
                    aten.nll_loss_nd.default})
"""Losses over class scores and integer targets: (input, target, weight, reduction,
ignore_index[, label_smoothing]), reduction 0 none, 1 mean, 2 sum."""
SAME_SHAPE = frozenset({aten.contiguous.default, aten.clone.default, aten.to.dtype,
                        aten.to.dtype_layout, aten._to_copy.default, aten.alias.default})
FLATTEN = SAME_SHAPE | {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                        aten.flatten.using_ints}
"""Ops between the (batch, sequence) labels or scores and the flat rows a loss reads."""
_SUM = 2
_END = 2**62


def _reduction(node: torch.fx.Node) -> Any:
    """A loss node's reduction, positional or keyword."""
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", 1)


def _unflattened(node: Any) -> tuple[list[torch.fx.Node], Any]:
    """(the flattening ops read in turn, last first; the value before them)."""
    chain: list[torch.fx.Node] = []
    while isinstance(node, torch.fx.Node) and node.target in FLATTEN \
            and isinstance(val_of(node.args[0]), torch.Tensor):
        chain.append(node)
        node = node.args[0]
        if val_of(node).dim() > val_of(chain[-1]).dim():
            break
    return chain, node


def target_cut(node: torch.fx.Node, local: set[torch.fx.Node], seq: Any
               ) -> tuple[torch.fx.Node, torch.fx.Node] | str:
    """(the whole (batch, sequence) targets, the op that reads them on their way to the
    loss ``node``): the targets to cut to local rows there; or why ``node`` is refused."""
    if _reduction(node) not in (1, _SUM):
        return ("a per-token loss (reduction 'none') of a chunk: reduce it with 'mean' or "
                "'sum' inside the model, or return the logits")
    target = node.args[1]
    if val_of(target) is None or val_of(target).dtype.is_floating_point:
        return "a loss with probability targets (class indices are split by sequence)"
    scores_chain, scores = _unflattened(node.args[0])
    labels_chain, labels = _unflattened(target)
    if scores not in local or seq_dims(scores, seq) != (1,) or not labels_chain \
            or labels in local or not isinstance(val_of(labels), torch.Tensor) \
            or val_of(labels).dim() != val_of(scores).dim() - 1 or not scores_chain:
        return ("a loss whose targets the rewrite cannot pair with the local tokens (it "
                "pairs (batch, sequence, classes) scores flattened beside (batch, sequence) "
                "targets)")
    return labels, labels_chain[-1]


def loss_parts(op: Any, scores: torch.Tensor, target: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum of the token losses, what their mean divides it by) of ``op`` on these
    tokens: the count of targets not ignored, or their class weights' sum."""
    names = ("weight", "reduction", "ignore_index")
    given = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    rest = args[3:]
    extra = {k: v for k, v in kwargs.items() if k not in names}
    weight, ignore = given.get("weight"), given.get("ignore_index", -100)
    total = op(scores, target, weight, _SUM, ignore, *rest, **extra)
    counted = target != ignore
    if weight is None:
        count = counted.sum()
    else:
        count = weight.index_select(0, target.masked_select(counted)).sum()
    return total, count.to(total.dtype)


def cp_loss(op: Any, scores: torch.Tensor, target: torch.Tensor, *args: Any,
            **kwargs: Any) -> torch.Tensor:
    """``op`` (a ``LOSSES`` op) over every cp rank's tokens, as one process computes it from
    the whole sequence; this rank's ``scores`` and ``target`` are its tokens."""
    if not collectives.active():
        out: torch.Tensor = op(scores, target, *args, **kwargs)
        return out
    total, count = loss_parts(op, scores, target, *args, **kwargs)
    reduction = args[1] if len(args) > 1 else kwargs.get("reduction", 1)
    if reduction == _SUM:
        return collectives.cp_sum(total)
    return collectives.cp_sum(total) / collectives.cp_sum(count.detach())


def _slice_under(node: Any, dim: int, start: int, end: int
                 ) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(the slice ``[start:end]`` along ``dim`` that ``node`` reads through ops keeping its
    shape, the op reading that slice), or None."""
    reader = None
    while isinstance(node, torch.fx.Node) and node.target in SAME_SHAPE:
        reader, node = node, node.args[0]
    if not isinstance(node, torch.fx.Node) or node.target is not aten.slice.Tensor \
            or reader is None or len(node.users) != 1:
        return None
    args: tuple[Any, ...] = (*node.args, 0, 0, None)[:4] if len(node.args) < 4 \
        else tuple(node.args)
    stop = args[3] if args[3] is not None else _END
    if not all(isinstance(a, int) for a in (args[1], args[2], stop)):
        return None
    at_end = stop >= _END if end == _END else stop == end
    if args[1] % val_of(node).dim() != dim or args[2] != start or not at_end:
        return None
    return node, reader


def _between(starts: set[torch.fx.Node], end: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes from ``starts`` to ``end`` (both included), in graph order."""
    before: set[torch.fx.Node] = set()
    todo = [end]
    while todo:
        n = todo.pop()
        if n not in before:
            before.add(n)
            todo += n.all_input_nodes
    out: list[torch.fx.Node] = []
    for n in end.graph.nodes:
        if n in before and (n in starts or any(a in out for a in n.all_input_nodes)):
            out.append(n)
    return out


def _refake(nodes: list[torch.fx.Node]) -> None:
    """Recompute the traced values (fake tensors) of ``nodes``, in order."""
    for n in nodes:
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), val_of)
        n.meta["val"] = n.target(*args, **kwargs)  # type: ignore[operator]


def pad_shifted_labels(gm: torch.fx.GraphModule) -> list[str]:
    """transformers 4.x's shift, ``loss(scores[:, :-1], labels[:, 1:])``, rewritten as
    ``loss(scores, pad(labels[:, 1:], ignored))``: the same sum and count, the scores'
    sequence whole. The names of the losses rewritten."""
    done = []
    for loss in [n for n in gm.graph.nodes if n.target in LOSSES]:
        scores_chain, scores = _unflattened(loss.args[0])
        labels_chain, labels = _unflattened(loss.args[1])
        if not scores_chain or not labels_chain:
            continue
        cut = _slice_under(scores, 1, 0, -1)
        shifted = _slice_under(labels, 1, 1, _END)
        if cut is None or shifted is None:
            continue
        ignore = loss.args[4] if len(loss.args) > 4 else loss.kwargs.get("ignore_index", -100)
        cut[1].replace_input_with(cut[0], cut[0].args[0])  # type: ignore[arg-type]
        with gm.graph.inserting_after(shifted[0]):
            pad = gm.graph.call_function(aten.constant_pad_nd.default,
                                         (shifted[0], [0, 1], ignore))
        pad.meta = dict(shifted[0].meta)
        shifted[1].replace_input_with(shifted[0], pad)
        _refake(_between({pad, cut[1]}, loss))
        done.append(loss.name)
    return done


def loss_targets(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes a loss's targets derive from: computed whole (inputs among them not split)."""
    todo = [n.args[1] for n in gm.graph.nodes if n.target in LOSSES
            and isinstance(n.args[1], torch.fx.Node)]
    seen: set[torch.fx.Node] = set()
    while todo:
        n = todo.pop()
        if isinstance(n, torch.fx.Node) and n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


__all__ = ["LOSSES", "cp_loss", "loss_parts", "loss_targets", "pad_shifted_labels",
           "target_cut"]
