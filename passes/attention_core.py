"""The attention core, ``softmax(q k^T) v`` between the projections, found on the graph.

Selective recomputation (Korthikanti et al. 2022) recomputes only this part, the one
keeping the most bytes per FLOP; planner and runtime use this one finder. See
docs/memory.md, 'Selective recomputation'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx

from passes import meta

CORE_PATH = frozenset({"div", "truediv", "mul", "add", "masked_fill", "where", "dropout",
                       "softmax", "to", "type_as", "float", "view", "reshape", "expand",
                       "transpose", "contiguous"})
"""Ops a core may hold between its softmax and its matmuls."""
CORE_ENDS = frozenset({"matmul", "bmm", "baddbmm", "einsum_mm"})
"""Ops that end a core: the scores' and the context's matmuls."""
META_READS = frozenset({"getattr", "size", "dim", "numel"})
"""Reads of a value's metadata (a ``.dtype``, a size): they do not keep it outside."""


def _op(node: torch.fx.Node) -> str:
    return str(getattr(meta.COST.get(node), "op", ""))


def _grow(seed: torch.fx.Node, inside: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The softmax ``seed`` and the core ops around it, out to the matmuls. Going back, a
    value something else computes with too (a mask every layer adds) stays an input."""
    core = {seed}
    for direction in ("in", "out"):
        todo = [seed]
        while todo:
            cur = todo.pop()
            for m in (cur.all_input_nodes if direction == "in" else list(cur.users)):
                op = _op(m)
                if m not in inside or m in core or (op not in CORE_PATH
                                                    and op not in CORE_ENDS):
                    continue
                if direction == "in" and any(u not in core and _op(u) not in META_READS
                                             for u in m.users):
                    continue
                core.add(m)
                if op not in CORE_ENDS:
                    todo.append(m)
    return core


def _closed(core: set[torch.fx.Node], order: dict[torch.fx.Node, int],
            inside: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """``core`` with every node that both reads it and feeds it (a ``.dtype`` or a size
    read off the scores), so that it runs as one call."""
    lo, hi = min(order[n] for n in core), max(order[n] for n in core)
    after: set[torch.fx.Node] = set(core)
    for n in sorted((n for n in inside if lo <= order[n] <= hi), key=order.__getitem__):
        if any(m in after for m in n.all_input_nodes):
            after.add(n)
    feeds = set(core)
    for n in sorted(after, key=order.__getitem__, reverse=True):
        if any(u in feeds for u in n.users):
            feeds.add(n)
    return core | (after & feeds)


def attention_cores(nodes: Sequence[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Each attention core among ``nodes`` (in graph order), as its nodes in graph order:
    an ``sdpa`` node alone, or a softmax grown out to its two matmuls (module docstring);
    a softmax without a matmul on each side (a router's) is not one."""
    inside = set(nodes)
    order = {n: i for i, n in enumerate(nodes)}
    taken: set[torch.fx.Node] = set()
    cores: list[set[torch.fx.Node]] = []
    for n in nodes:
        op = _op(n)
        if n in taken or op not in ("sdpa", "softmax"):
            continue
        if op == "sdpa":
            core = {n}
        else:
            grown = _grow(n, inside)
            ends = [order[m] for m in grown if _op(m) in CORE_ENDS]
            if not ends or min(ends) > order[n] or max(ends) < order[n]:
                continue  # no matmul on one side: a softmax of something else (a router)
            core = _closed(grown, order, inside)
        core -= taken
        taken |= core
        cores.append(core)
    return [sorted(c, key=order.__getitem__) for c in cores]


__all__ = ["CORE_ENDS", "CORE_PATH", "META_READS", "attention_cores"]
