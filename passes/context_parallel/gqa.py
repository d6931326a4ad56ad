"""Grouped-query attention under context parallelism: gather the small keys and values.

Hugging Face repeats each key/value head to the query heads before
``scaled_dot_product_attention`` (unsqueeze, expand, reshape). Gathering after that repeat
would move heads/kv-heads times the bytes, so the gather moves before it: the repeat then
runs on the whole sequence (its sizes back to the whole length) and ``cp_sdpa`` is told
that operand is whole already.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from passes.context_parallel import collectives

aten = torch.ops.aten
REPEAT = frozenset({aten.expand.default, aten.reshape.default, aten.view.default,
                    aten.unsqueeze.default, aten.slice.Tensor, aten.clone.default,
                    aten._unsafe_view.default})
"""Ops a head repeat is made of (a full slice is how export writes ``x[:, :, None]``)."""


def repeat_chain(operand: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node] | None:
    """(the repeat's nodes, the attention operand first; the small value they repeat), or
    None when ``operand`` is not an expand of one value read by nothing else."""
    chain: list[torch.fx.Node] = []
    node = operand
    while node.target in REPEAT and (not chain or len(node.users) == 1):
        chain.append(node)
        src = node.args[0]
        if not isinstance(src, torch.fx.Node):
            return None
        node = src
    if not any(n.target is aten.expand.default for n in chain):
        return None
    return chain, node


def gather_small(graph: torch.fx.Graph, chain: list[torch.fx.Node], small: torch.fx.Node,
                 originals: dict[torch.fx.Node, torch.fx.Node], insert: Any) -> torch.fx.Node:
    """Feed the repeat ``chain`` the whole sequence of ``small`` (gathered along dim -2)
    and give its sizes back their whole-length nodes (``originals``: local -> whole)."""
    with graph.inserting_after(small):
        whole = insert(graph, collectives.cp_gather_kv, (small, -2), small, small)
    chain[-1].replace_input_with(small, whole)
    for node in chain:
        for arg in list(node.all_input_nodes):
            if arg in originals:
                node.replace_input_with(arg, originals[arg])
    return whole


__all__ = ["gather_small", "repeat_chain"]
