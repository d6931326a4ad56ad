"""The split backward: a chunk's input gradients now (I), its weight gradients later (W).

Both come from the autograd graph the forward recorded, so nothing is computed twice: I
asks for the input-path gradients and records what each join (where a parameter's path
meets it) was given; W resumes from those joins. See docs/schedules.md, 'The split
backward'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Join:
    node: Node
    grads: tuple[torch.Tensor | None, ...] | None = None
    params: list[torch.Tensor] = field(default_factory=list)
    roots: list[torch.Tensor] = field(default_factory=list)
    """Set for a root off the input path (an output made from parameters alone): W starts
    from these outputs with their given gradients (``grads``) instead of the node's."""


@dataclass
class PendingW:
    """One microbatch's W on one chunk: the joins with their recorded gradients, or the
    roots themselves when the chunk has no input path."""

    joins: list[_Join]
    roots: list[torch.Tensor] = field(default_factory=list)
    root_grads: list[torch.Tensor] = field(default_factory=list)
    root_params: list[torch.Tensor] = field(default_factory=list)
    shared: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)
    """Parameters used twice in the chunk: autograd reaches them through the input path
    anyway, so I computes their gradients and W only accumulates them."""

    @property
    def held_grad_bytes(self) -> int:
        """Bytes of the gradients recorded at the joins (what W adds to the kept graph)."""
        return sum(g.numel() * g.element_size() for j in self.joins for g in j.grads or ()
                   if g is not None)


def _edge(t: torch.Tensor) -> GradientEdge:
    return get_gradient_edge(t)


class Accumulators:
    """One chunk's parameters' AccumulateGrad nodes, each looked up once instead of twice per
    I (a lookup builds a view, ~9 us): I of a 2-Linear chunk 31-78 us (5-11 %) faster
    (docs/performance.md). Holding a node keeps it its parameter's for later forwards, as
    DDP's reducer does; a parameter whose tensor was swapped is looked up again."""

    def __init__(self) -> None:
        self._nodes: dict[int, tuple[torch.Tensor, Node]] = {}

    def of(self, p: torch.Tensor) -> Node:
        hit = self._nodes.get(id(p))
        if hit is not None and hit[0] is p and hit[1].variable is p:  # type: ignore[attr-defined]
            return hit[1]
        node = _edge(p).node
        self._nodes[id(p)] = (p, node)
        return node


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node under ``roots`` -> the nodes whose next functions name it."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    todo = list(roots)
    while todo:
        node = todo.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in parents:
                parents[nxt] = []
                todo.append(nxt)
            parents[nxt].append(node)
    return parents


def _above(starts: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``starts`` and every node that reaches one of them (toward the roots)."""
    seen = {s for s in starts if s in parents}
    todo = list(seen)
    while todo:
        for up in parents[todo.pop()]:
            if up not in seen:
                seen.add(up)
                todo.append(up)
    return seen


def input_grads(roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor],
                inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                accumulators: Accumulators | None = None,
                in_input_pass: Sequence[torch.Tensor] = ()
                ) -> tuple[list[torch.Tensor | None], PendingW]:
    """I: the gradients of ``inputs`` (None where one needs none), and what W needs
    (``accumulators``: the chunk's, kept between calls). ``in_input_pass``: parameters whose
    gradients I computes, as for ``shared`` ones (read inside a compiled region)."""
    used = [(r, g) for r, g in zip(roots, root_grads) if r.requires_grad]
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    trainable = [p for p in params if p.requires_grad]
    if not used:
        return [None] * len(inputs), PendingW([])
    root_nodes = [_edge(r).node for r, _ in used]  # a relayed input is its own root
    parents = _parents(root_nodes)
    input_nodes = [_edge(t).node for t in wanted]
    path = _above(input_nodes, parents)
    node_of = (accumulators or Accumulators()).of
    accs = [node_of(p) for p in trainable]
    if not path:  # nothing to give back: W is the whole backward
        return [None] * len(inputs), PendingW(
            [], [r for r, _ in used], [g for _, g in used],
            [p for p, acc in zip(trainable, accs) if acc in parents])
    joins: dict[Node, _Join] = {}
    reached: dict[Node, int] = {}
    rooted = set(root_nodes)
    for p, acc in zip(trainable, accs):
        if acc not in parents:
            continue  # the chunk's outputs do not depend on it
        todo, seen = [acc], {acc}
        while todo:
            node = todo.pop()
            # a root made of parameters alone, whose own gradient W starts from; one that
            # also feeds the input path is joined there too (the parameter is then shared)
            if node in rooted and node not in path:
                mine = [(r, g) for (r, g), rn in zip(used, root_nodes) if rn is node]
                join = joins.setdefault(node, _Join(node, roots=[r for r, _ in mine]))
                join.grads = tuple(g for _, g in mine)
                if all(q is not p for q in join.params):
                    join.params.append(p)
                    reached[acc] = reached.get(acc, 0) + 1
            for up in parents[node]:
                if up in path:
                    join = joins.setdefault(up, _Join(up))
                    if all(q is not p for q in join.params):
                        join.params.append(p)
                        reached[acc] = reached.get(acc, 0) + 1
                elif up not in seen:
                    seen.add(up)
                    todo.append(up)
    forced = {id(p) for p in in_input_pass}
    shared = [p for p, acc in zip(trainable, accs)
              if reached.get(acc, 0) > 1 or (id(p) in forced and acc in reached)]
    for join in joins.values():
        join.params = [p for p in join.params if all(p is not q for q in shared)]
    handles = [j.node.register_prehook(_recorder(j)) for j in joins.values()
               if j.params and not j.roots]
    try:
        asked: Any = [*wanted, *map(_edge, shared)]  # tensors and edges: both are allowed
        got = torch.autograd.grad([r for r, _ in used], asked, [g for _, g in used],
                                  retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    it = iter(got[:len(wanted)])
    grads = [next(it) if isinstance(t, torch.Tensor) and t.requires_grad else None
             for t in inputs]
    pending = PendingW([j for j in joins.values() if j.params])
    pending.shared = [(_edge(p), g) for p, g in zip(shared, got[len(wanted):]) if g is not None]
    return grads, pending


def _recorder(join: _Join) -> Any:
    def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        join.grads = tuple(grad_outputs)

    return record


def weight_grads(pending: PendingW) -> None:
    """W: accumulate every parameter's gradient from what ``input_grads`` kept."""
    for edge, grad in pending.shared:  # through its AccumulateGrad: its hooks fire
        torch.autograd.backward([edge], [grad])
    if pending.roots:
        torch.autograd.backward(pending.roots, pending.root_grads, inputs=pending.root_params)
        return
    for join in pending.joins:
        if join.grads is None:
            continue  # the join got no gradient: its parameters get none this microbatch
        if join.roots:
            torch.autograd.backward(join.roots, list(join.grads), inputs=join.params)
            continue
        outs = [GradientEdge(join.node, i) for i, g in enumerate(join.grads) if g is not None]
        torch.autograd.backward(outs, [g for g in join.grads if g is not None],
                                inputs=join.params)
