"""``assign_manual``: stages from ``smp.partition`` pins, for ``auto_partition: False``.

A node belongs to its innermost pinned module, else ``default_partition``; glue follows
its data so it never sends a value back. With ``check_forward`` a value going back is an
``SMPPartitionError``; without, the pins name ranks and ``passes.manual_chunks`` cuts them
into chunks. See docs/partitioning.md, 'Manual'.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.fx

from cost_model.errors import SMPPartitionError
from passes import meta
from passes.graph_utils import copy_graph_module
from passes.in_place import colocate
from passes.partitioning.extract import COMPUTE_OPS


def _pin_for(path: str, pins: Mapping[str, int]) -> int | None:
    """Index of the innermost pinned module containing ``path`` (None: no pinned ancestor)."""
    parts = path.split(".") if path else []
    for end in range(len(parts), 0, -1):
        index = pins.get(".".join(parts[:end]))
        if index is not None:
            return index
    return None


def assign_manual(gm: torch.fx.GraphModule, pins: Mapping[str, int], default_partition: int,
                  num_stages: int, check_forward: bool = True) -> torch.fx.GraphModule:
    """New GraphModule with ``STAGE`` on every node (and ``PIN`` on module nodes)."""
    for path, index in sorted(pins.items()):
        if not isinstance(index, int) or not 0 <= index < num_stages:
            raise SMPPartitionError.build(
                "smp.partition index must be below the number of partitions", index,
                f"module '{path}' (partitions: {num_stages})",
                f"use an index in 0..{num_stages - 1} or raise pipeline_parallel_degree")
    if not 0 <= default_partition < num_stages:
        raise SMPPartitionError.build(
            "default_partition must be below the number of partitions", default_partition,
            f"config (partitions: {num_stages})", f"use 0..{num_stages - 1}")
    root_default = pins.get("", default_partition)
    new = copy_graph_module(gm)
    nodes = list(new.graph.nodes)
    glue: list[torch.fx.Node] = []
    for n in nodes:
        if n.op not in COMPUTE_OPS:
            continue
        path = meta.MODULE_PATH.get(n) or (str(n.target) if n.op == "call_module" else "")
        if not path:
            glue.append(n)
            ins = [meta.STAGE.get(a) for a in n.all_input_nodes if meta.STAGE.has(a)]
            if ins:
                meta.STAGE.set(n, int(max(ins)))
            continue
        pin = _pin_for(path, pins)
        index = root_default if pin is None else pin
        meta.PIN.set(n, index)
        meta.STAGE.set(n, index)
    for n in reversed(glue):  # input-less glue: earliest user, else the default
        if not meta.STAGE.has(n):
            users = [meta.STAGE.get(u) for u in n.users if meta.STAGE.has(u)]
            meta.STAGE.set(n, int(min(users, default=root_default)))
    compute = {n.name: n for n in nodes if n.op in COMPUTE_OPS}
    kept = colocate(new, {k: int(meta.STAGE.get(n)) for k, n in compute.items()},
                    lambda name: not meta.PIN.has(compute[name]))
    for name, n in compute.items():
        meta.STAGE.set(n, kept[name])
    for n in reversed(nodes):
        if n.op in ("placeholder", "get_attr"):
            users = [meta.STAGE.get(u) for u in n.users if meta.STAGE.has(u)]
            meta.STAGE.set(n, int(min(users, default=root_default)))
    for n in nodes:
        if n.op == "output":
            ins = [meta.STAGE.get(a) for a in n.all_input_nodes if a.op in COMPUTE_OPS]
            meta.STAGE.set(n, int(max(ins, default=num_stages - 1)))
    if check_forward:
        _check_forward(new)
    return new


def backward_edge(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """The first (producer, consumer) compute edge of ``gm`` (``STAGE`` on every node) that
    goes to an earlier stage, or None when the stages form a pipeline."""
    for n in gm.graph.nodes:
        if n.op not in COMPUTE_OPS:
            continue
        s = meta.STAGE.get(n)
        for a in n.all_input_nodes:
            if a.op in COMPUTE_OPS and meta.STAGE.get(a) > s:
                return a, n
    return None


def _check_forward(gm: torch.fx.GraphModule) -> None:
    """Every compute edge goes to the same or a later stage, else name the offending pair."""
    edge = backward_edge(gm)
    if edge is None:
        return
    a, n = edge
    s = meta.STAGE.get(n)
    raise SMPPartitionError.build(
        "manual partitions must form a pipeline: a value cannot go from a later "
        "stage to an earlier one",
        f"{a.name} (module '{meta.MODULE_PATH.get(a) or ''}', stage "
        f"{meta.STAGE.get(a)}) -> {n.name} (module '{meta.MODULE_PATH.get(n) or ''}'"
        f", stage {s})",
        "the consumer's module",
        "place modules in execution order (earlier modules on lower or equal "
        "partitions), e.g. move the consumer's module to partition "
        f">= {meta.STAGE.get(a)} or the producer's to <= {s}")
