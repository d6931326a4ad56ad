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
- a layer does not count the head's values (rotary tables): every layer shares them.

``elementwise_saving`` prices each fused group as one kernel: one read of what it reads
from outside, one write of what leaves it, against the ops one by one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch.fx

from cost_model.device import DeviceSpec
from cost_model.roofline import node_times
from passes import meta
from passes.checkpoint_regions import COMPUTE
from passes.tensor_parallel.costs import COLLECTIVES

KERNELS = frozenset({"linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "conv", "sdpa",
                     "embedding"})
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


def _laid_out(n: torch.fx.Node, head: Collection[str]) -> torch.fx.Node:
    """The value ``n`` lays out (through views, transposes, repeats), or the chunk a
    sequence gather gathers."""
    while n.op == "call_function" and (_op(n) in LAYOUT or meta.TP.get(n) == GATHER):
        inputs = _activations(n, head)
        if len(inputs) != 1:
            break
        n = inputs[0]
    return n


def _groups(nodes: Sequence[torch.fx.Node], head: Collection[str]) -> dict[str, int]:
    """Each element-wise node's fused group (connected element-wise nodes)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    fused = [n for n in nodes if n.op in COMPUTE and not _is_kernel(n)
             and not _is_residual(n, head)]
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
    graph = {n.name: n for n in nodes[0].graph.nodes} if nodes else {}
    group = _groups(nodes, head)
    kept: dict[str, int] = {}
    extra = 0
    for n in nodes:
        if n.op not in COMPUTE:
            continue
        saved = meta.SAVED.get(n)
        if saved is None:
            extra += meta.COST.get(n).saved_bytes if meta.COST.has(n) else 0
            continue
        extra += saved.extra
        for key, nbytes in saved.keys:
            owner = graph.get(key.split("[", 1)[0].split("#", 1)[0])
            if owner is None:  # a node the tensor-parallel rewrite replaced: a linear's
                kept[key] = nbytes  # output, its bytes already this rank's
                continue
            if owner.name in head or owner.op == "get_attr":
                continue
            if n.name in group and group.get(owner.name) == group[n.name] and not (
                    owner is n and any(group.get(u.name) != group[n.name] for u in n.users)):
                continue  # recomputed inside the fused kernel
            if _is_kernel(n):
                value = _laid_out(owner, head)
                if value is not owner:
                    kept[value.name] = _nbytes(value)
                    continue
            kept[key] = nbytes
    return sum(kept.values()) + extra


def elementwise_saving(nodes: Sequence[torch.fx.Node], spec: DeviceSpec
                       ) -> tuple[float, float]:
    """(forward, backward) seconds saved by running each element-wise group of ``nodes``
    as one fused kernel (Megatron-Core's RMSNorm, SwiGLU, RoPE) instead of op by op: the
    group's node times less one kernel's moving its inputs and outputs once."""
    group = _groups(nodes, ())
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
    return fwd, bwd


__all__ = ["KERNELS", "LAYOUT", "elementwise_saving", "fused_saved"]
