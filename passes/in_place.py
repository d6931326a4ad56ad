"""In-place writes kept in order across pipeline stages.

Stages exchange copies, so a tensor written in place is right elsewhere only if it leaves
its stage after every write that precedes a read: the tensor, its views and the reads the
writes order run on one stage (``colocate``; ``check`` refuses a split). A tensor detached
in place stays with its producer too (a received copy is a view).
See docs/architecture.md, 'Stage assignment and splitting'.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping

import torch
import torch.fx

from cost_model.errors import SMPPartitionError
from passes.partitioning.extract import COMPUTE_OPS

log = logging.getLogger("smp_fx.passes.in_place")

VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "expand", "expand_as", "transpose",
    "permute", "t", "unsqueeze", "squeeze", "narrow", "select", "flatten", "unflatten",
    "as_strided", "chunk", "split", "unbind", "diagonal", "unfold", "__getitem__",
    "contiguous", "detach", "movedim", "swapaxes", "real", "imag"})
"""Tensor methods whose result may share the storage of the tensor they are called on."""
VIEW_FUNCTIONS = frozenset({
    operator.getitem, torch.transpose, torch.flatten, torch.reshape, torch.narrow,
    torch.select, torch.squeeze, torch.unsqueeze, torch.chunk, torch.split, torch.unbind,
    torch.permute, torch.t, torch.diagonal, torch.detach, torch.movedim, torch.swapaxes})


def _schema(node: torch.fx.Node) -> torch.FunctionSchema | None:
    target = node.target
    return target._schema if isinstance(target, torch._ops.OpOverload) else None


METADATA_ONLY = frozenset({"detach_", "requires_grad_", "retain_grad"})
"""In-place methods that change autograd's view of a tensor, not its values."""


def _op_name(node: torch.fx.Node) -> str:
    schema = _schema(node)
    return schema.name.split("::")[-1] if schema is not None else str(node.target)


def _metadata_pairs(nodes: list[torch.fx.Node]) -> list[frozenset[str]]:
    """Each in-place metadata op (``detach_``) with the compute node whose tensor it
    changes: a stage receives a view of the transport's buffer, which autograd refuses to
    detach in place (export writes ``torch.tensor(c)`` in a forward as ``lift_fresh_copy``
    then ``detach_``: a cut between the two would fail the step)."""
    pairs = []
    for n in nodes:
        first = n.args[0] if n.op in COMPUTE_OPS and n.args else None
        if isinstance(first, torch.fx.Node) and first.op in COMPUTE_OPS \
                and _op_name(n) in METADATA_ONLY:
            pairs.append(frozenset((first.name, n.name)))
    return pairs


def written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors ``node`` writes in place: an ATen op's mutable arguments, ``t[i] = v``,
    a ``name_`` method's receiver, a function called with ``inplace=True``."""
    if node.op not in COMPUTE_OPS:
        return []
    schema = _schema(node)
    if _op_name(node) in METADATA_ONLY:
        return []
    if schema is not None:
        return [a for arg, a in zip(schema.arguments, node.args) if isinstance(a, torch.fx.Node)
                and arg.alias_info is not None and arg.alias_info.is_write]
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node):
        return []
    if node.op == "call_function" and node.target is operator.setitem:
        return [first]
    if node.op == "call_method" and str(node.target).endswith("_") and \
            not str(node.target).endswith("__"):
        return [first]
    return [first] if node.kwargs.get("inplace") is True else []


def view_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor whose storage ``node``'s result may share (a view, or the written tensor
    an in-place op returns), else None."""
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node):
        return None
    schema = _schema(node)
    if schema is not None:
        aliased = any(r.alias_info is not None for r in schema.returns)
        return first if aliased else None
    if node.op == "call_method" and node.target in VIEW_METHODS or \
            node.op == "call_function" and node.target in VIEW_FUNCTIONS:
        return first
    return written(node)[0] if written(node) else None


def groups(gm: torch.fx.GraphModule) -> tuple[frozenset[str], ...]:
    """The compute nodes (by name) that must share a stage: one group per written tensor,
    and each in-place metadata op with its tensor (``_metadata_pairs``)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    aliases: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    writes: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in nodes:
        source = view_of(n) if n.op in COMPUTE_OPS else None
        root[n] = root.get(source, source) if source is not None else n
        aliases.setdefault(root[n], []).append(n)
        for t in written(n):
            writes.setdefault(root.get(t, t), []).append(n)
    found = []
    for base, ws in writes.items():
        last = max(order[w] for w in ws)
        group = {u for a in aliases[base] for u in (a, *a.users) if order[u] <= last}
        if base.op in ("placeholder", "get_attr"):  # each stage reads its own copy
            same = [n for n in nodes if n.op == base.op and n.target == base.target]
            group |= {u for n in same for u in n.users}
        names = frozenset(n.name for n in group if n.op in COMPUTE_OPS)
        if len(names) > 1:
            found.append(names)
    return tuple(found + _metadata_pairs(nodes))


def colocate(gm: torch.fx.GraphModule, stages: Mapping[str, int],
             movable: Callable[[str], bool] = lambda name: True) -> dict[str, int]:
    """``stages`` (compute node -> stage) with each group on one stage: its pinned stage
    (``movable`` false) if it has one, else the latest of its members'; the users of a
    moved node follow it. Pinned on two stages is an ``SMPPartitionError``."""
    out = dict(stages)
    found = groups(gm)
    if not found:
        return out
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    changed = True
    while changed:
        changed = False
        for group in found:
            pinned = {out[n] for n in group if not movable(n)}
            if len(pinned) > 1:
                raise SMPPartitionError.build(
                    "a tensor written in place and the reads ordered by the write must run on "
                    "one stage", {n: out[n] for n in sorted(group)}, "passes.in_place",
                    "pin the modules that write and read it to one partition")
            target = pinned.pop() if pinned else max(out[n] for n in group)
            for n in group:
                if out[n] != target:
                    out[n], changed = target, True
        for n in compute:
            late = max((out[m.name] for m in n.all_input_nodes if m.name in out),
                       default=out[n.name])
            if late > out[n.name] and movable(n.name):
                out[n.name], changed = late, True
    moved = sorted(n for n in out if out[n] != stages[n])
    if moved:
        log.info("smp-fx: %d node(s) moved to keep in-place writes in order across stages: "
                 "%s", len(moved), ", ".join(moved[:8]))
    return out


def check(gm: torch.fx.GraphModule, stage_of: Callable[[torch.fx.Node], int]) -> None:
    """Refuse a stage assignment that splits a group (module docstring)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for group in groups(gm):
        where = {n: stage_of(by_name[n]) for n in sorted(group)}
        if len(set(where.values())) > 1:
            raise SMPPartitionError.build(
                "a tensor written in place and the reads ordered by the write must run on one "
                "stage (stages exchange copies)", where, "split_stages",
                "assign the stages with auto_partition or assign_manual, which keep them "
                "together (passes.in_place.colocate)")
