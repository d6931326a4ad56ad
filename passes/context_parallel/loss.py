"""A loss computed inside the model, under context parallelism: over every rank's tokens.

On a chunk, a cross-entropy's mean is over the rank's own tokens. ``cp_loss`` makes it
one process's: each rank's sum of token losses and its count of counted tokens (their
class weights, if any) are summed over cp, and the loss is one over the other. The
targets are computed whole (Hugging Face shifts the labels inside the loss: a pad and a
slice of the whole sequence, so the chunks' boundaries get their next tokens) and cut to
the local tokens where the loss reads them, before they are flattened (``target_cut``).
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
FLATTEN = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                     aten.contiguous.default, aten.clone.default, aten.to.dtype,
                     aten.to.dtype_layout, aten._to_copy.default, aten.flatten.using_ints,
                     aten.alias.default})
"""Ops between the (batch, sequence) labels or scores and the flat rows a loss reads."""
_SUM = 2


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


__all__ = ["LOSSES", "cp_loss", "loss_parts", "loss_targets", "target_cut"]
