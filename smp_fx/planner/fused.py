"""The activations a part keeps as Megatron-Core keeps them, to price runs made with it.

Why: smp-fx runs a Hugging Face layer op by op and autograd keeps what each op saves
(``passes.annotate_costs``): RMSNorm's float32 intermediates, the gathered sequence under
sequence parallelism, keys and values repeated to every head, SwiGLU's silu output, the
attention output's transposed copy. Megatron-Core runs fused kernels and keeps about half
of that on a Llama layer. The rules, on the same graph and saved-value account:

- kernels (GEMMs, attention, embeddings) keep what they save, read through layout ops
  (flash attention takes grouped keys and values; Megatron's layouts need no copy); a
  linear fed by a sequence gather keeps the chunk and gathers it again in backward;
- element-wise ops between them (RMSNorm, RoPE, SwiGLU: fused kernels) keep the values
  they read from outside their group, not its intermediates; a residual add ends a group;
- an eager attention core (matmul, softmax, matmul: a model transformers builds without
  sdpa) is one flash-attention kernel: it keeps its inputs and output, not its scores;
- a layer does not count the head's values (rotary tables): every layer shares them.

``elementwise_saving`` prices each fused group as one kernel: one read of what it reads
from outside, one write of what leaves it, against the ops one by one; an eager attention
core at the device's attention rate (``sdpa``) on its two matmuls' FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch.fx

from cost_model.device import DeviceSpec
from cost_model.roofline import node_times
from passes import meta
from passes.checkpoint_regions import COMPUTE
from passes.tensor_parallel.costs import COLLECTIVES

KERNELS = frozenset({"linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "conv", "sdpa",
                     "embedding", "grouped_mm"})
LAYOUT = frozenset({"view", "reshape", "transpose", "permute", "expand", "unsqueeze",
                    "squeeze", "slice", "contiguous", "flatten", "unflatten", "t", "alias",
                    "clone"})
GATHER = "tp_seq_gather"


def _op(n: torch.fx.Node) -> str:
    cost = meta.COST.get(n) if meta.COST.has(n) else None
    return cost.op if cost is not None else ""


def _is_kernel(n: torch.fx.Node) -> bool:
    return _op(n) in KERNELS or meta.TP.get(n) in COLLECTIVES


def _activations(n: torch.fx.Node, head: Collection[str]) -> list[torch.fx.Node]:
    return [a for a in n.all_input_nodes if a.op != "get_attr" and a.name not in head
            and meta.TENSOR.get(a) is not None]


def _is_residual(n: torch.fx.Node, head: Collection[str]) -> bool:
    """A sum of two activations: its own kernel in Megatron-Core (bias-dropout-add)."""
    return _op(n) in ("add", "sub") and len(_activations(n, head)) >= 2


def _nbytes(n: torch.fx.Node) -> int:
    info = meta.TENSOR.get(n)
    infos = info if isinstance(info, tuple) else (info,)
    return sum(int(getattr(x, "nbytes", 0) or 0) for x in infos)


def _owners(nodes: Sequence[torch.fx.Node]) -> Callable[[str], torch.fx.Node | None]:
    """The node a saved-value key of ``nodes``' graph names (``passes.annotate_costs``'s
    ``name[index]`` / ``name#version`` keys), or None for one the graph no longer has."""
    graph = {n.name: n for n in nodes[0].graph.nodes} if nodes else {}
    return lambda key: graph.get(key.split("[", 1)[0].split("#", 1)[0])


def _laid_out(n: torch.fx.Node, head: Collection[str]) -> torch.fx.Node:
    """The value ``n`` lays out (through views, transposes, repeats), or the chunk a
    sequence gather gathers."""
    while n.op == "call_function" and (_op(n) in LAYOUT or meta.TP.get(n) == GATHER):
        inputs = _activations(n, head)
        if len(inputs) != 1:
            break
        n = inputs[0]
    return n


def eager_cores(nodes: Sequence[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """Each softmax of ``nodes`` with the non-kernel ops around it out to a matmul on each
    side (scores, mask, sinks, context): an attention core written op by op."""
    inside = {n for n in nodes if n.op in COMPUTE}
    order = {n: i for i, n in enumerate(nodes)}
    cores: list[list[torch.fx.Node]] = []
    taken: set[torch.fx.Node] = set()
    for seed in nodes:
        if _op(seed) != "softmax" or seed in taken:
            continue
        core, ends = {seed}, {"in": 0, "out": 0}
        for way in ("in", "out"):
            todo = [seed]
            while todo:
                cur = todo.pop()
                for m in cur.all_input_nodes if way == "in" else list(cur.users):
                    if m not in inside or m in core or (_is_kernel(m) and _op(m) != "matmul"):
                        continue
                    core.add(m)
                    if _op(m) == "matmul":
                        ends[way] += 1
                    else:
                        todo.append(m)
        if ends["in"] and ends["out"]:
            taken |= core
            cores.append(sorted(core, key=order.__getitem__))
    return cores


def _groups(nodes: Sequence[torch.fx.Node], head: Collection[str],
            cores: Collection[str] = ()) -> dict[str, int]:
    """Each element-wise node's fused group (connected element-wise nodes)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    fused = [n for n in nodes if n.op in COMPUTE and not _is_kernel(n)
             and not _is_residual(n, head) and n.name not in cores]
    for n in fused:
        parent[n.name] = n.name
    for n in fused:
        for a in n.all_input_nodes:
            if a.name in parent:
                parent[find(a.name)] = find(n.name)
    roots: dict[str, int] = {}
    return {n.name: roots.setdefault(find(n.name), len(roots)) for n in fused}


def fused_saved(nodes: Sequence[torch.fx.Node], head: Collection[str] = ()) -> int:
    """Bytes one microbatch keeps on ``nodes`` under Megatron-Core's kernels (module
    docstring); ``head``: names of the head's nodes, whose values a layer does not count."""
    owner_of = _owners(nodes)
    core = {n.name: i for i, c in enumerate(eager_cores(nodes)) for n in c}
    group = _groups(nodes, head, core)
    kept: dict[str, int] = {}
    extra = 0
    for n in nodes:
        if n.op not in COMPUTE:
            continue
        saved = meta.SAVED.get(n)
        in_core = n.name in core  # a core keeps no scores, masks or statistics
        if saved is None:
            extra += meta.COST.get(n).saved_bytes if meta.COST.has(n) and not in_core else 0
            continue
        extra += 0 if in_core else saved.extra
        for key, nbytes in saved.keys:
            owner = owner_of(key)
            if owner is None:  # a node the tensor-parallel rewrite replaced: a linear's
                kept[key] = nbytes  # output, its bytes already this rank's
                continue
            if owner.name in head or owner.op == "get_attr":
                continue
            if n.name in group and group.get(owner.name) == group[n.name] and not (
                    owner is n and any(group.get(u.name) != group[n.name] for u in n.users)):
                continue  # recomputed inside the fused kernel
            if in_core and core.get(owner.name) == core[n.name]:
                continue
            if _is_kernel(n) or in_core:
                value = _laid_out(owner, head)
                if value is not owner:
                    kept[value.name] = _nbytes(value)
                    continue
            kept[key] = nbytes
    return sum(kept.values()) + extra


def gathered_surplus(nodes: Sequence[torch.fx.Node],
                     skip: Collection[torch.fx.Node] = ()) -> int:
    """Bytes the ops of ``nodes`` (but ``skip``) keep of a gathered sequence beyond its
    chunk: smp-fx's linear saves the sequence-parallel input it gathered, Megatron keeps
    the 1/t chunk and gathers it again in backward (Korthikanti et al. 2022, section
    4.2.2), ``4sbh (1 - 1/t)`` a GPT layer (its QKV and first MLP linears). The rule that
    ``fused_saved`` applies under Megatron-Core's kernels, for Megatron-LM's op-by-op
    accounting (``smp_fx.planner.overlap.MEGATRON_LM``)."""
    owner_of = _owners(nodes)
    surplus: dict[str, int] = {}
    for n in nodes:
        saved = meta.SAVED.get(n) if n.op in COMPUTE and n not in skip else None
        for key, nbytes in saved.keys if saved is not None else ():
            owner = owner_of(key)
            if owner is None or meta.TP.get(owner) != GATHER or key in surplus:
                continue
            chunk = _laid_out(owner, ())  # the gather's input: what Megatron keeps
            surplus[key] = 0 if chunk is owner else max(0, nbytes - _nbytes(chunk))
    return sum(surplus.values())


def elementwise_saving(nodes: Sequence[torch.fx.Node], spec: DeviceSpec
                       ) -> tuple[float, float]:
    """(forward, backward) seconds saved by running each element-wise group of ``nodes``
    as one fused kernel (Megatron-Core's RMSNorm, SwiGLU, RoPE) instead of op by op: the
    group's node times less one kernel's moving its inputs and outputs once."""
    cores = eager_cores(nodes)
    group = _groups(nodes, (), {n.name for c in cores for n in c})
    members: dict[int, list[torch.fx.Node]] = {}
    for n in nodes:
        if n.name in group:
            members.setdefault(group[n.name], []).append(n)
    fwd = bwd = 0.0
    for grp in members.values():
        inside = {n.name for n in grp}
        costs = [meta.COST.get(n) for n in grp if meta.COST.has(n)]
        reads = {a.name: _nbytes(a) for n in grp for a in n.all_input_nodes
                 if a.name not in inside and a.op != "get_attr"}
        writes = sum(_nbytes(n) for n in grp if any(u.name not in inside for u in n.users))
        moved = sum(reads.values()) + writes
        if not moved:
            continue
        elems = writes / 2
        one_f, one_b = node_times("add", spec, fwd_flops=0.0, bwd_flops=0.0,
                                  out_elems=elems, moved=moved)
        fwd += max(0.0, sum(c.fwd_time_s for c in costs) - one_f)
        bwd += max(0.0, sum(c.bwd_time_s for c in costs) - one_b)
    for c in cores:
        costs = [meta.COST.get(n) for n in c if meta.COST.has(n)]
        flops = sum(x.fwd_flops for x in costs if x.op in KERNELS)
        out = _nbytes(c[-1])
        one_f, one_b = node_times("sdpa", spec, fwd_flops=flops, bwd_flops=2 * flops,
                                  out_elems=out / 2, moved=4 * out, dtype="bfloat16",
                                  seq=_keys(c), head_dim=_head_dim(c))
        fwd += sum(x.fwd_time_s for x in costs) - one_f
        bwd += sum(x.bwd_time_s for x in costs) - one_b
    return fwd, bwd


def _keys(core: Sequence[torch.fx.Node]) -> float | None:
    """The key length of an eager attention core: its softmax's last dimension."""
    for n in core:
        info = meta.TENSOR.get(n)
        shape = getattr(info, "shape", None)
        if _op(n) == "softmax" and shape:
            return float(shape[-1])
    return None


def _head_dim(core: Sequence[torch.fx.Node]) -> float | None:
    """The head dimension of an eager attention core: the last dimension of the queries its
    scores matmul reads."""
    for n in core:
        if _op(n) == "matmul" and n.all_input_nodes:
            shape = getattr(meta.TENSOR.get(n.all_input_nodes[0]), "shape", None)
            return float(shape[-1]) if shape else None
    return None


__all__ = ["KERNELS", "LAYOUT", "eager_cores", "elementwise_saving", "fused_saved",
           "gathered_surplus"]
