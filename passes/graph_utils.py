"""Copying a GraphModule without touching the original: the basis of "passes never mutate".

The copy gets a deep-copied ``Graph`` (new ``Node`` objects whose ``meta`` dicts are shallow
copies, which is safe because every ``smp.*`` value is immutable) and shares the parameter,
buffer and submodule objects with the original: weights are never duplicated, so copying a
meta-device GPT-2-XL graph costs nothing. Unreferenced state (e.g. a tied alias such as
``lm_head.weight``) is re-registered so ``state_dict()`` keys stay exactly the model's.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.fx
from torch import nn


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A new Graph with new nodes; node meta copied (shallowly), output meta included."""
    with warnings.catch_warnings():  # pytree codegen deepcopy warns about LeafSpec
        warnings.simplefilter("ignore", FutureWarning)
        new = copy.deepcopy(graph)
    old_out = next(n for n in reversed(graph.nodes) if n.op == "output")
    new_out = next(n for n in reversed(new.nodes) if n.op == "output")
    new_out.meta = dict(old_out.meta)
    for old, fresh in zip(graph.nodes, new.nodes):
        if old.name != fresh.name:  # deepcopy keeps names; a mismatch would misplace meta
            raise AssertionError(f"graph copy renamed {old.name} to {fresh.name}")
        fresh.meta = dict(old.meta)
    return new


def copy_graph_module(gm: torch.fx.GraphModule,
                      graph: torch.fx.Graph | None = None) -> torch.fx.GraphModule:
    """A GraphModule over ``graph`` (default: a copy of ``gm.graph``) sharing ``gm``'s state."""
    new_graph = copy_graph(gm.graph) if graph is None else graph
    out = torch.fx.GraphModule(gm, new_graph, type(gm).__name__)
    attach_state(out, gm)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


def attach_state(dst: nn.Module, src: nn.Module) -> None:
    """Register on ``dst`` every parameter/buffer of ``src`` it lacks (same objects)."""
    have = set(dst.state_dict(keep_vars=True))
    for name, value in src.state_dict(keep_vars=True).items():
        if name in have:
            continue
        owner_path, _, leaf = name.rpartition(".")
        owner = dst
        for part in owner_path.split(".") if owner_path else ():
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(value, nn.Parameter):
            owner.register_parameter(leaf, value)
        else:
            owner.register_buffer(leaf, value)


def node_by_name(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    for node in gm.graph.nodes:
        if node.name == name:
            return node
    raise KeyError(name)
