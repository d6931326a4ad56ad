"""Repeated layers: find them in a traced graph and keep two, so each is priced once.

Why: a 1T-parameter GPT has 128 identical transformer layers; pricing every node of every
layer for every microbatch size and tensor-parallel degree the planner tries would take
minutes. The layers of a ``ModuleList`` (``h.0`` .. ``h.127``) run the same ops on the same
shapes, so the planner keeps the graph's head (everything before the first layer), two
layers and its tail (everything after the last), prices that small graph with the
compiler's own passes, and counts the second layer ``count - 1`` times. Two, not one: the
first layer may differ from the others (a sequence-parallel region starts in it).

A graph qualifies when the layers' node sequences match op for op (same node kinds,
targets and parameter shapes), each layer's segment (its nodes and the glue up to the next
layer) is contiguous, and nothing after the layers reads a layer's values other than the
last layer's, the way each layer reads only its predecessor's. Otherwise ``find_repeats``
returns None and the planner prices the whole graph (slower, same result).

``torch.export`` graphs need tidying first (``tidy``): export reads every parameter at
the top of the graph, where the head would own them all, and computes a size the layers
share once, where the first layer needs it (Mixtral's experts read batch x sequence), so
that the later layers read the first one's node. ``tidy`` moves each parameter read to
just before its first reader, in that parameter's module, and such size arithmetic (ints
computed from the inputs' shapes alone) up to the inputs, where it belongs to the head.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from passes import meta
from passes.graph_utils import copy_graph_module

KEPT = 2
"""Layers the reduced graph keeps: the first, and one that stands for all the others."""


@dataclass(frozen=True)
class Repeats:
    """``count`` layers ``{parent}.0`` .. ``{parent}.{count - 1}`` of ``size`` nodes each."""

    parent: str
    count: int
    size: int

    def layer_path(self, index: int) -> str:
        return f"{self.parent}.{index}" if self.parent else str(index)


def layer_of(path: str) -> tuple[str, int] | None:
    """(parent, index) of the first numbered component of a module path.

    >>> layer_of("transformer.h.11.attn.c_attn"), layer_of("ln_f")
    (('transformer.h', 11), None)
    """
    parts = (path or "").split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def _segments(gm: torch.fx.GraphModule) -> tuple[str, list[list[torch.fx.Node]]] | None:
    """The parent with the most numbered layers and each layer's segment (its first node up
    to the next layer's first node; the last one up to its last node)."""
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    nodes = list(gm.graph.nodes)
    for i, n in enumerate(nodes):
        key = layer_of(meta.MODULE_PATH.get(n, "") or "")
        if key is not None and n.op not in ("placeholder", "output"):
            first.setdefault(key, i)
            last[key] = i
    counts: dict[str, int] = {}
    for parent, _ in first:
        counts[parent] = counts.get(parent, 0) + 1
    if not counts:
        return None
    parent = max(counts, key=lambda p: (counts[p], -len(p)))
    indices = sorted(i for p, i in first if p == parent)
    if indices != list(range(len(indices))) or len(indices) < KEPT + 1:
        return None
    starts = [first[(parent, i)] for i in indices]
    if starts != sorted(starts):
        return None
    ends = starts[1:] + [last[(parent, indices[-1])] + 1]
    return parent, [nodes[a:b] for a, b in zip(starts, ends)]


def _signature(node: torch.fx.Node, gm: torch.fx.GraphModule, prefix: str) -> tuple[object, ...]:
    target: object = node.target
    if node.op in ("call_module", "get_attr"):
        rel = str(node.target)[len(prefix):] if str(node.target).startswith(prefix) else None
        owner = str(node.target)
        try:
            obj = gm.get_submodule(owner) if node.op == "call_module" else None
        except AttributeError:
            obj = None
        target = (rel, type(obj).__name__ if obj is not None else None)
    shapes = tuple(tuple(p.shape) for p in _params_of(node, gm))
    return node.op, target, len(node.args), shapes


def _params_of(node: torch.fx.Node, gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    out = []
    for name in meta.PARAMS.get(node, ()) or ():
        try:
            out.append(operator.attrgetter(name)(gm))
        except AttributeError:
            continue
    return out


SIZE_METHODS = frozenset({"size", "dim", "numel"})


def _is_size(node: torch.fx.Node, sizes: set[torch.fx.Node]) -> bool:
    """Whether ``node`` computes an int from the inputs' shapes alone (``sizes``: the
    nodes known to do so): export records it as an int value; an fx graph, which records
    none, as ``x.size()`` / ``x.shape`` of an input and arithmetic on those."""
    inputs = node.all_input_nodes
    if node.op not in ("call_function", "call_method") or not inputs or \
            not all(a.op == "placeholder" or a in sizes for a in inputs):
        return False
    val: Any = node.meta.get("val")
    if val is not None:
        return isinstance(val, (int, torch.SymInt, torch.SymBool))
    if node.op == "call_method":
        return node.target in SIZE_METHODS
    if node.target is getattr:
        return len(node.args) > 1 and node.args[1] == "shape"
    return all(a in sizes for a in inputs) and \
        getattr(node.target, "__module__", None) in ("_operator", "operator")


def tidy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with its parameter reads next to their readers and its size
    arithmetic on the inputs' shapes after the inputs (module docstring)."""
    out = copy_graph_module(gm)
    nodes = list(out.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.op == "get_attr" and n.users:
            first = min(n.users, key=position.__getitem__)
            if n.next is not first:
                first.prepend(n)
            meta.MODULE_PATH.set(n, str(n.target).rpartition(".")[0])
    anchor = next((n for n in reversed(nodes) if n.op == "placeholder"), None)
    sizes: set[torch.fx.Node] = set()
    for n in list(out.graph.nodes):
        if anchor is not None and _is_size(n, sizes):
            sizes.add(n)
            if anchor.next is not n:
                anchor.append(n)
            meta.MODULE_PATH.set(n, "")
            anchor = n
    out.graph.lint()
    out.recompile()
    return out


def find_repeats(gm: torch.fx.GraphModule) -> Repeats | None:
    """The repeated layers of ``gm`` (module docstring), or None."""
    found = _segments(gm)
    if found is None:
        return None
    parent, segments = found
    size = len(segments[0])
    pre = [f"{parent}.{i}." if parent else f"{i}." for i in range(len(segments))]
    sig0 = [_signature(n, gm, pre[0]) for n in segments[0]]
    for i, seg in enumerate(segments[1:], start=1):
        if len(seg) != size and i != len(segments) - 1:
            return None
        if len(seg) > size or [_signature(n, gm, pre[i]) for n in seg] != sig0[:len(seg)]:
            return None
    seg_of = {n: i for i, seg in enumerate(segments) for n in seg}
    for i, seg in enumerate(segments):
        for n in seg:
            for user in n.users:
                j = seg_of.get(user)
                if j is None and i != len(segments) - 1 and user not in seg_of:
                    return None  # a value of an inner layer read after the layers
                if j is not None and j not in (i, i + 1):
                    return None
    return Repeats(parent, len(segments), size)


def keep_layers(gm: torch.fx.GraphModule, repeats: Repeats) -> torch.fx.GraphModule:
    """A copy of ``gm`` with layers ``KEPT`` .. ``count - 1`` removed; what read the last
    layer's values reads layer ``KEPT - 1``'s (``gm`` is not modified)."""
    out = copy_graph_module(gm)
    found = _segments(out)
    assert found is not None
    _, segments = found
    keep = segments[KEPT - 1]
    drop = [n for seg in segments[KEPT:] for n in seg]
    dropped = set(drop)
    last = segments[-1]
    for offset, n in enumerate(last):
        for user in list(n.users):
            if user not in dropped:
                user.replace_input_with(n, keep[offset])
    for n in reversed(drop):
        out.graph.erase_node(n)
    out.graph.lint()
    # a GraphModule built on the graph holds only the modules and tensors it reads: the
    # dropped layers' weights are not faked again by every later pass
    small = torch.fx.GraphModule(out, out.graph, type(gm).__name__)
    small.meta = {**dict(getattr(gm, "meta", {})),
                  "smp.kept_layers": (repeats.parent, repeats.count, KEPT)}
    return small


__all__ = ["KEPT", "Repeats", "find_repeats", "keep_layers", "layer_of", "tidy"]
