"""In-place writes into a tensor nothing else shares, made out-of-place at capture.

A custom ``autograd.Function`` is inlined by export, its own backward lost: transformers
4.46 DeBERTa-v2's ``XSoftmax`` writes ``masked_fill_`` into the softmax output that torch's
softmax backward then reads ("modified by an inplace operation"). Where the written tensor
has no view, the out-of-place op computes the same values; its later readers take the new
result. Part of the export capture, on its own fresh graph (``passes/trace.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode

from passes.in_place import view_of, written

log = logging.getLogger("smp_fx.passes.fresh_writes")


def _functional(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    """The out-of-place twin of an ATen op that writes only its first argument, else None."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or node.kwargs.get("out") is not None:
        return None
    schema = target._schema
    mutable = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if len(mutable) != 1 or schema.arguments[0] is not mutable[0]:
        return None
    base = schema.name.split("::")[-1]
    if not base.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, base[:-1], None)
    twin = getattr(packet, target._overloadname, None) if packet is not None else None
    if twin is None or any(a.alias_info is not None for a in twin._schema.arguments):
        return None
    return twin


def _same_result(node: torch.fx.Node, twin: torch._ops.OpOverload) -> bool:
    """Whether ``twin`` on the recorded fake values gives the write's shape and dtype (an
    out-of-place op may promote where the in-place one keeps its tensor's dtype)."""
    vals = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    want = node.meta.get("val")
    mode = detect_fake_mode(vals)
    if not isinstance(want, torch.Tensor) or mode is None:
        return False
    try:
        with mode:
            got: Any = twin(*vals[0], **vals[1])
    except Exception as exc:  # an op the fake mode cannot run stays in place
        log.debug("%s kept in place: %s", node.name, exc)
        return False
    return isinstance(got, torch.Tensor) and got.dtype == want.dtype and \
        got.shape == want.shape


def _unshared(tensor: torch.fx.Node) -> bool:
    """A compute result no other tensor views (its in-place writes aside)."""
    if tensor.op != "call_function" or view_of(tensor) is not None:
        return False
    return all(written(n) == [tensor] for n in tensor.users if view_of(n) is tensor)


def make_out_of_place(graph: torch.fx.Graph) -> list[str]:
    """Rewrite ``graph``'s in-place writes into unshared tensors (module docstring); the
    names of the writes rewritten."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    done = []
    for node in nodes:
        twin = _functional(node)
        if twin is None or written(node) != [node.args[0]]:
            continue
        tensor = node.args[0]
        assert isinstance(tensor, torch.fx.Node)
        if not _unshared(tensor) or not _same_result(node, twin):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(twin, node.args, node.kwargs)
        new.meta = dict(node.meta)
        order[new] = order[node]
        for user in list(tensor.users):
            if user is not node and user is not new and order[user] > order[node]:
                user.replace_input_with(tensor, new)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        done.append(node.name)
    if done:
        log.info("smp-fx: %d in-place write(s) into unshared tensors made out-of-place: %s",
                 len(done), ", ".join(done[:8]))
    return done
