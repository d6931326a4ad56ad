"""Copying a GraphModule without touching the original: the basis of "passes never mutate".

The copy has new nodes with the same names, shallow-copied meta (every ``smp.*`` value is
immutable) and the original's codegen, but shares parameters and submodules, so copying a
meta-device GPT-2-XL costs nothing. See docs/architecture.md, 'node.meta'.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.fx
from torch import nn


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A new Graph with new nodes (``Graph.__deepcopy__``: ``graph_copy``, which copies each
    node's meta shallowly, plus the code generator) and the output node's meta."""
    with warnings.catch_warnings():  # pytree codegen deepcopy warns about LeafSpec
        warnings.simplefilter("ignore", FutureWarning)
        new = copy.deepcopy(graph)
    old_out = next(n for n in reversed(graph.nodes) if n.op == "output")
    new_out = next(n for n in reversed(new.nodes) if n.op == "output")
    new_out.meta = dict(old_out.meta)
    return new


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule over a copy of ``gm.graph`` sharing ``gm``'s state (module doc)."""
    out = torch.fx.GraphModule(gm, copy_graph(gm.graph), type(gm).__name__)
    attach_state(out, gm)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


def tensor_at(root: nn.Module, fqn: str) -> torch.Tensor | None:
    """The tensor at a dotted attribute path of ``root`` (a parameter, a buffer or a plain
    tensor attribute), or None where the path ends early or names no tensor."""
    obj: object = root
    for part in fqn.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def owner_of(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """(the module holding the attribute at dotted path ``fqn`` of ``root``, its last
    name): where a parameter, buffer or tensor attribute is registered."""
    owner_path, _, leaf = fqn.rpartition(".")
    return (root.get_submodule(owner_path) if owner_path else root), leaf


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
