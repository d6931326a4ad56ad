"""Activation checkpointing in the compiler: which nodes are recomputed, and what it saves.

``mark_regions`` runs before the partitioner, ``keep_whole`` and ``settle_regions`` after;
``stage_activations`` is the plan's exact account of what one microbatch keeps on a
stage. See docs/memory.md, 'In the compiler'.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch.fx

from cost_model.errors import SMPPartitionError
from passes import meta
from passes.attention_core import attention_cores
from passes.graph_utils import copy_graph_module
from passes.partition_config import ATTENTION_CORE, CheckpointRule, PartitionConfig
from passes.partitioning.extract import problem_from_graph, write_stages
from passes.partitioning.problem import evaluate, make_objective

log = logging.getLogger("smp_fx.checkpointing")
COMPUTE = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Region:
    """A set of nodes run as one checkpointed call; ``per_stage``: cut at stage boundaries."""

    name: str
    preserve_rng_state: bool = True
    per_stage: bool = False


@dataclass(frozen=True)
class StageActivations:
    """Bytes one microbatch keeps on a stage for backward (see the module docstring)."""

    saved: int
    region_inputs: int
    transient: int
    regions: tuple[str, ...]
    rebuilt: int = 0
    """Every region's own saved values together: what recomputing them all rebuilds (a
    split backward's I rebuilds each region once and keeps it until the W)."""


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def region_for(path: str, rules: Sequence[CheckpointRule]) -> Region | None:
    """The region a node of module ``path`` belongs to (the outermost rule wins);
    ``attention_core`` rules are the graph's (``core_regions``)."""
    for rule in sorted(rules, key=lambda r: (r.module_path.count(".") if r.module_path
                                             else -1, r.module_path)):
        if rule.strategy == ATTENTION_CORE or not _under(path, rule.module_path):
            continue
        if not rule.children:
            return Region(rule.module_path, rule.preserve_rng_state)
        rest = path[len(rule.module_path):].lstrip(".") if rule.module_path else path
        child = rest.split(".")[0]
        if child not in rule.children:
            return None  # the container's own code: not part of any child
        size = rule.group_size
        pre = f"{rule.module_path}." if rule.module_path else ""
        if size == 0:
            return Region(rule.module_path or "<root>", rule.preserve_rng_state, True)
        k = rule.children.index(child)
        lo, hi = k - k % size, min(k - k % size + size, len(rule.children)) - 1
        name = (f"{pre}{rule.children[lo]}" if lo == hi
                else f"{pre}[{rule.children[lo]}-{rule.children[hi]}]")
        return Region(name, rule.preserve_rng_state)
    return None


def core_regions(nodes: Sequence[torch.fx.Node], rules: Sequence[CheckpointRule]
                 ) -> dict[str, tuple[Region, list[torch.fx.Node]]]:
    """Selective recomputation: each attention core (``passes.attention_core``) under an
    ``attention_core`` rule's module, outside every other region, as a region named after
    the module of its softmax (or ``sdpa``) node."""
    out: dict[str, tuple[Region, list[torch.fx.Node]]] = {}
    taken: set[torch.fx.Node] = set()  # rules may nest: a core is found once
    for rule in (r for r in rules if r.strategy == ATTENTION_CORE):
        free = [n for n in nodes if n.op in COMPUTE and not meta.CKPT_REGION.has(n)
                and n not in taken
                and _under(meta.MODULE_PATH.get(n, "") or "", rule.module_path)]
        for core in attention_cores(free):
            taken.update(core)
            seed = next(n for n in core if getattr(meta.COST.get(n), "op", "") in
                        ("sdpa", "softmax"))
            base = f"{meta.MODULE_PATH.get(seed, '') or '<root>'}.attention_core"
            name = base if base not in out else f"{base}@{seed.name}"
            out[name] = (Region(name, rule.preserve_rng_state), core)
    return out


def mark_regions(gm: torch.fx.GraphModule, rules: Sequence[CheckpointRule]
                 ) -> torch.fx.GraphModule:
    """A copy of ``gm`` with ``CKPT_REGION`` and checkpointed costs (see module doc)."""
    out = copy_graph_module(gm)
    members: dict[str, list[torch.fx.Node]] = {}
    for node in out.graph.nodes:
        if node.op not in COMPUTE:
            continue
        region = region_for(meta.MODULE_PATH.get(node, "") or "", rules)
        if region is not None:
            meta.CKPT_REGION.set(node, region)
            members.setdefault(region.name, []).append(node)
    for name, (region, core) in core_regions(list(out.graph.nodes), rules).items():
        for node in core:
            meta.CKPT_REGION.set(node, region)
        members[name] = core
    for nodes in members.values():
        inputs = sum(b for _, b in _input_storages(nodes).items())
        for i, node in enumerate(nodes):
            plain = meta.COST.get(node)
            meta.PLAIN_COST.set(node, plain)
            meta.COST.set(node, dataclasses.replace(
                plain, saved_bytes=inputs if i == 0 else 0,
                bwd_time_s=plain.bwd_time_s + plain.fwd_time_s))
    return out


def keep_whole(gm: torch.fx.GraphModule, pconfig: PartitionConfig,
               comm_time: Callable[[float], float] | None = None) -> torch.fx.GraphModule:
    """After automatic partitioning: a region the partitioner cut moves whole to the first
    or the last stage it touched, whichever keeps the stages contiguous and scores better
    under the partitioner's objective; a region neither move can keep whole stays cut
    (``settle_regions`` then drops it). ``gm`` is not modified."""
    problem = problem_from_graph(gm)
    obj = make_objective(problem, pconfig, comm_time)
    index = {name: i for i, name in enumerate(problem.names)}
    stage = np.asarray([meta.STAGE.get(n) for n in gm.graph.nodes if n.name in index],
                       dtype=np.int64)
    members: dict[str, list[int]] = {}
    for n in gm.graph.nodes:
        region = meta.CKPT_REGION.get(n)
        if region is not None and not region.per_stage and n.name in index:
            members.setdefault(region.name, []).append(index[n.name])
    changed = False
    for idx in members.values():
        touched = sorted({int(stage[i]) for i in idx})
        if len(touched) < 2:
            continue
        best, best_score = None, float("inf")
        for target in (touched[0], touched[-1]):
            cand = stage.copy()
            cand[idx] = target
            if not _monotone(cand, problem.preds) or len(set(cand.tolist())) < len(
                    set(stage.tolist())):
                continue
            score = evaluate(problem, cand, obj).bottleneck
            if score < best_score:
                best, best_score = cand, score
        if best is not None:
            stage, changed = best, True
    if not changed:
        return gm
    return write_stages(gm, dict(zip(problem.names, (int(s) for s in stage))))


def _monotone(stage: np.ndarray, preds: Sequence[Sequence[int]]) -> bool:
    return all(stage[p] <= stage[i] for i, ps in enumerate(preds) for p in ps)


def settle_regions(gm: torch.fx.GraphModule, manual: bool) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose regions each lie on one stage (see the module docstring)."""
    out = copy_graph_module(gm)
    members: dict[str, list[torch.fx.Node]] = {}
    for node in out.graph.nodes:
        region = meta.CKPT_REGION.get(node)
        if region is not None:
            members.setdefault(region.name, []).append(node)
    for name, nodes in members.items():
        stages = sorted({meta.STAGE.get(n) for n in nodes})
        region = meta.CKPT_REGION.get(nodes[0])
        if region.per_stage:
            for n in nodes:
                s = meta.STAGE.get(n)
                meta.CKPT_REGION.set(n, dataclasses.replace(
                    region, name=name if len(stages) == 1 else f"{name}@{s}"))
            continue
        if len(stages) > 1:
            if manual:
                raise SMPPartitionError.build(
                    "a checkpointed module lies on one stage", f"{name!r} on stages {stages}",
                    "manual partitioning (smp.partition)",
                    "place the whole module in one smp.partition context, or checkpoint "
                    "its children instead")
            log.warning("activation checkpointing of %r skipped: the partitioner split it "
                        "across stages %s", name, stages)
            _drop(nodes)
    for name, nodes in _by_region(out).items():
        if not _convex(out, nodes):
            log.warning("activation checkpointing of %r skipped: an outside node between "
                        "its nodes reads it and feeds it", name)
            _drop(nodes)
    return out


def _drop(nodes: Iterable[torch.fx.Node]) -> None:
    for n in nodes:
        del n.meta[meta.CKPT_REGION.name]
        meta.COST.set(n, meta.PLAIN_COST.get(n))


def _by_region(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    out: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        region = meta.CKPT_REGION.get(node)
        if region is not None:
            out.setdefault(region.name, []).append(node)
    return out


def _convex(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]) -> bool:
    """No node outside ``nodes`` both depends on one of them and feeds a later one."""
    inside = set(nodes)
    tainted: set[torch.fx.Node] = set()
    started = False
    for node in gm.graph.nodes:
        if node is nodes[0]:
            started = True
        if not started:
            continue
        if node in inside:
            if any(m in tainted for m in node.all_input_nodes):
                return False
            if node is nodes[-1]:
                return True
        elif any(m in inside or m in tainted for m in node.all_input_nodes):
            tainted.add(node)
    return True


def region_inputs(nodes: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """Values a region reads from outside it (parameters and buffers excluded), in order."""
    inside = set(nodes)
    out: list[torch.fx.Node] = []
    for n in nodes:
        for m in n.all_input_nodes:
            if m not in inside and m.op != "get_attr" and m not in out:
                out.append(m)
    return out


def _input_storages(nodes: Sequence[torch.fx.Node]) -> dict[str, int]:
    """The storages a region keeps of its inputs; a view of a parameter or buffer (a
    causal mask's slice) is held anyway, not kept by the region."""
    out: dict[str, int] = {}
    attrs = {n.name for n in nodes[0].graph.nodes if n.op == "get_attr"} if nodes else set()
    for m in region_inputs(nodes):
        saved = meta.SAVED.get(m)
        if saved is not None and saved.storage[1] and saved.storage[0] not in attrs:
            out[saved.storage[0]] = saved.storage[1]
    return out


def _keys(nodes: Iterable[torch.fx.Node]) -> tuple[dict[str, int], int]:
    keys: dict[str, int] = {}
    extra = 0
    for n in nodes:
        saved = meta.SAVED.get(n)
        if saved is None:
            extra += meta.COST.get(n).saved_bytes if meta.COST.has(n) else 0
            continue
        keys.update(saved.keys)
        extra += saved.extra
    return keys, extra


def stage_activations(nodes: Sequence[torch.fx.Node]) -> StageActivations:
    """What one microbatch keeps for backward on the stage made of ``nodes``."""
    plain = [n for n in nodes if n.op in COMPUTE and not meta.CKPT_REGION.has(n)]
    regions: dict[str, list[torch.fx.Node]] = {}
    for n in nodes:
        region = meta.CKPT_REGION.get(n)
        if region is not None and n.op in COMPUTE:
            regions.setdefault(region.name, []).append(n)
    keys, extra = _keys(plain)
    held = dict(keys)
    inputs: dict[str, int] = {}
    transient = rebuilt = 0
    for members in regions.values():
        inputs.update(_input_storages(members))
        own, own_extra = _keys(members)
        transient = max(transient, sum(own.values()) + own_extra)
        rebuilt += sum(own.values()) + own_extra
    held.update(inputs)
    leaving = sum(b for k, b in inputs.items() if k not in keys)
    return StageActivations(sum(held.values()) + extra, leaving, transient,
                            tuple(regions), rebuilt)
