"""What each part of a model costs one tensor-parallel rank, from the compiler's own passes.

Why: the planner must price a plan with the same code that prices ``smp-fx partition`` and
``DistributedModel``'s plan. For a microbatch size, a tensor-parallel degree and sequence
parallelism it runs, on the graph ``smp_fx.planner.layers`` reduced to two layers,
``shape_prop`` -> ``annotate_costs`` (node times on the device spec: GEMM efficiency by
shape, attention, memory-bound kernels by bandwidth) -> ``tensor_parallel`` (the rewrite
the runtime runs: sharded work divided, its all-reduces, all-gathers and reduce-scatters
priced on the NVLink link by ``cost_model.collectives``) -> ``reprice_gemms`` (each
shard's GEMMs with their own waves), then sums the nodes of each part
(head, first layer, one repeated layer, tail) into a ``PartCost``: forward and backward
time, the tensor-parallel share of it, the weight-gradient share (what a zero-bubble
schedule defers: half a linear's backward), FLOPs, parameters, and the activations a
microbatch keeps under each recomputation mode, counted by
``passes.checkpoint_regions.stage_activations`` (the plan's exact account):

- ``none``: what the part's nodes save;
- ``full``: a layer keeps its inputs; its own saved values exist once more while it is
  recomputed (the transient), and the backward first re-runs its forward;
- ``selective``: each attention core (``passes.attention_core``, as the runtime's
  ``recompute_granularity: selective`` finds it) keeps its inputs and is re-run.

The head and the tail are never recomputed. Without repeated layers every computing node
is a part of its own and only ``none`` applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from cost_model.device import DeviceSpec
from passes import meta
from passes.annotate_costs import annotate_costs
from passes.attention_core import attention_cores
from passes.checkpoint_regions import COMPUTE, Region, stage_activations
from passes.reprice_gemms import reprice_gemms
from passes.shape_prop import shape_prop
from passes.tensor_parallel import TensorParallelism, tensor_parallel
from passes.tensor_parallel.costs import COLLECTIVES
from smp_fx.planner.exchange import dispatch_bytes, expert_ids, kv_bytes
from smp_fx.planner.expert_gemm import GroupedGemm, grouped_gemms
from smp_fx.planner.fused import elementwise_saving, fused_saved, gathered_surplus
from smp_fx.planner.layers import KEPT, Repeats, layer_of

RECOMPUTE = ("none", "selective", "full")
PERSISTENCE_THRESHOLD = 1_000_000
"""SMP's default ``sdp_param_persistence_threshold``: smaller tensors are not sharded."""
WGRAD_OPS = frozenset({"linear", "matmul", "addmm", "mm", "conv"})
"""Ops whose backward is half input gradient, half weight gradient (when they read a
parameter)."""
@dataclass(frozen=True)
class PartCost:
    """One part for one microbatch on one tensor-parallel rank (module docstring)."""

    fwd_s: float
    bwd_s: float
    wgrad_s: float
    tp_fwd_s: float
    tp_bwd_s: float
    fwd_flops: float
    bwd_flops: float
    saved: int
    saved_full: int
    transient_full: int
    saved_selective: int
    transient_selective: int
    selective_fwd_s: float
    selective_flops: float
    param_elems: int
    param_tensors: int
    shared: tuple[tuple[str, int], ...]
    """Trainable tensors another part reads too (tied weights): (name, elements)."""
    buffer_bytes: int
    out_bytes: int
    """What crosses a pipeline boundary placed right after this part (values relayed)."""
    small_elems: int = 0
    """Elements of its trainable tensors below ``PERSISTENCE_THRESHOLD`` (shared ones
    included): sharded data parallelism keeps them whole."""
    expert_elems: int = 0
    """Of ``param_elems``, the experts expert parallelism splits (``exchange``)."""
    dispatch_bytes: int = 0
    """Bytes its MoE blocks' all-to-all sends each way per dispatch (``exchange``)."""
    kv_bytes: int = 0
    """Bytes of its attentions' keys and values at the whole sequence (``exchange``)."""
    grouped: tuple[GroupedGemm, ...] = ()
    """Its experts' grouped GEMMs, repriced per ep (``expert_gemm``)."""

    def times(self, recompute: str) -> tuple[float, float]:
        """(forward, backward) seconds; the backward re-runs what is recomputed."""
        if recompute == "full" and self.saved_full != self.saved:
            return self.fwd_s, self.bwd_s + self.fwd_s
        if recompute == "selective":
            return self.fwd_s, self.bwd_s + self.selective_fwd_s
        return self.fwd_s, self.bwd_s

    def kept(self, recompute: str) -> tuple[int, int]:
        """(bytes kept per microbatch, transient while recomputing)."""
        if recompute == "full":
            return self.saved_full, self.transient_full
        if recompute == "selective":
            return self.saved_selective, self.transient_selective
        return self.saved, 0

    def recompute_flops(self, recompute: str) -> float:
        if recompute == "full" and self.saved_full != self.saved:
            return self.fwd_flops
        return self.selective_flops if recompute == "selective" else 0.0


@dataclass(frozen=True)
class Profile:
    """A model's parts at one (microbatch size, tp, sp); ``parts[repeat[0]]`` stands for
    ``repeat[1]`` layers (``units`` expands it)."""

    mbs: int
    tp: int
    sp: bool
    parts: tuple[PartCost, ...]
    repeat: tuple[int, int]
    layers: int
    relay_bytes: int = 0
    """Head values every layer reads (relayed across each boundary between layers)."""
    output_bytes: int = 0
    """The model's outputs per microbatch (smp-fx sends them to every pipeline rank)."""
    replicated: tuple[tuple[str, str], ...] = ()

    def units(self) -> list[PartCost]:
        index, times = self.repeat
        return [*self.parts[:index], *([self.parts[index]] * times), *self.parts[index + 1:]]

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        return RECOMPUTE if self.layers else ("none",)


def _layer_part(node: torch.fx.Node, parent: str) -> int | None:
    key = layer_of(meta.MODULE_PATH.get(node, "") or "")
    return key[1] if key is not None and key[0] == parent else None


def split_parts(gm: torch.fx.GraphModule, repeats: Repeats | None) -> list[list[torch.fx.Node]]:
    """The nodes of each part, in graph order: head, layer 0, layer 1, tail (by position:
    glue between layers belongs to the layer before it), or one part per computing node."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    if repeats is None:
        return [[n] for n in nodes if n.op in COMPUTE or n.op == "placeholder"]
    where = [_layer_part(n, repeats.parent) for n in nodes]
    starts = [where.index(k) for k in range(KEPT)]
    last = max(i for i, k in enumerate(where) if k == KEPT - 1)
    bounds = [0, *starts, last + 1, len(nodes)]
    return [nodes[a:b] for a, b in zip(bounds, bounds[1:])]


def _with_regions(nodes: Sequence[torch.fx.Node],
                  regions: Sequence[Sequence[torch.fx.Node]]) -> tuple[int, int]:
    """(kept, transient) of ``nodes`` with each of ``regions`` recomputed (meta restored
    after)."""
    for i, region in enumerate(regions):
        for n in region:
            meta.CKPT_REGION.set(n, Region(f"region {i}"))
    try:
        acts = stage_activations(list(nodes))
    finally:
        for region in regions:
            for n in region:
                n.meta.pop(meta.CKPT_REGION.name, None)
    return acts.saved, acts.transient


def _param_table(gm: torch.fx.GraphModule) -> dict[str, tuple[int, int, bool]]:
    """name -> (tensor id, elements, trainable); tied names share the id."""
    table: dict[str, tuple[int, int, bool]] = {}
    for name, t in gm.named_parameters(remove_duplicate=False):
        table[name] = (id(t), t.numel(), t.requires_grad)
    for name, b in gm.named_buffers(remove_duplicate=False):
        table[name] = (id(b), b.numel() * b.element_size(), False)
    return table


def _part_cost(nodes: list[torch.fx.Node], later: set[torch.fx.Node], layer: bool,
               table: dict[str, tuple[int, int, bool]], readers: dict[int, int],
               names: dict[int, str], experts: dict[int, int],
               fused: frozenset[str] | None = None, sp_chunk: bool = False) -> PartCost:
    costs = [meta.COST.get(n) for n in nodes if meta.COST.get(n) is not None]
    tp_f = tp_b = wgrad = 0.0
    for n in nodes:
        c = meta.COST.get(n)
        if c is None:
            continue
        if meta.TP.get(n) in COLLECTIVES:
            tp_f, tp_b = tp_f + c.fwd_time_s, tp_b + c.bwd_time_s
        elif c.op in WGRAD_OPS and meta.PARAMS.get(n):
            wgrad += c.bwd_time_s / 2
    saved = stage_activations(list(nodes)).saved
    saved_full = transient_full = saved
    saved_sel, transient_sel, sel_s, sel_flops = saved, 0, 0.0, 0.0
    recomputed: set[torch.fx.Node] = set()
    if layer:
        compute = [n for n in nodes if n.op in COMPUTE]
        saved_full, transient_full = _with_regions(nodes, [compute])
        cores = attention_cores(compute)
        if cores:
            saved_sel, transient_sel = _with_regions(nodes, cores)
            sel_s = sum(meta.COST.get(n).fwd_time_s for c in cores for n in c)
            sel_flops = sum(meta.COST.get(n).fwd_flops for c in cores for n in c)
            recomputed = {n for c in cores for n in c}
    if sp_chunk and fused is None:  # Megatron-LM keeps a gathered sequence's chunk
        surplus = gathered_surplus(nodes)
        saved_sel -= gathered_surplus(nodes, recomputed) if recomputed else surplus
        saved -= surplus
    if fused is not None:  # Megatron-Core's kernels; its flash attention keeps no scores
        saved = fused_saved(nodes, fused if layer else ())
        if layer:
            transient_full, saved_sel = saved, saved
    own_elems = own_tensors = buffers = small = expert_elems = pick = 0
    shared: dict[str, int] = {}
    seen: set[int] = set()
    for n in nodes:
        for name in meta.PARAMS.get(n, ()) or ():
            if name not in table:
                continue
            tid, size, trainable = table[name]
            if tid in seen:
                continue
            seen.add(tid)
            if not trainable:
                buffers += size
                continue
            if size < PERSISTENCE_THRESHOLD:
                small += size
            if readers.get(tid, 1) > 1:
                shared[names[tid]] = size
            else:
                own_elems, own_tensors = own_elems + size, own_tensors + 1
                if tid in experts:
                    expert_elems, pick = expert_elems + size, max(pick, experts[tid])
    out_bytes = sum(_nbytes(n) for n in nodes if any(u in later for u in n.users))
    return PartCost(
        fwd_s=sum(c.fwd_time_s for c in costs), bwd_s=sum(c.bwd_time_s for c in costs),
        wgrad_s=wgrad, tp_fwd_s=tp_f, tp_bwd_s=tp_b,
        fwd_flops=sum(c.fwd_flops for c in costs), bwd_flops=sum(c.bwd_flops for c in costs),
        saved=saved, saved_full=saved_full, transient_full=transient_full,
        saved_selective=saved_sel, transient_selective=transient_sel, selective_fwd_s=sel_s,
        selective_flops=sel_flops, param_elems=own_elems, param_tensors=own_tensors,
        shared=tuple(sorted(shared.items())), buffer_bytes=buffers, out_bytes=out_bytes,
        small_elems=small, expert_elems=expert_elems,
        dispatch_bytes=dispatch_bytes(nodes, pick), kv_bytes=kv_bytes(nodes),
        grouped=grouped_gemms(nodes))


def _nbytes(node: torch.fx.Node) -> int:
    info = meta.TENSOR.get(node)
    infos = info if isinstance(info, tuple) else (info,)
    return sum(int(getattr(x, "nbytes", 0) or 0) for x in infos)


def price_parts(gm: torch.fx.GraphModule, repeats: Repeats | None, fused: bool = False,
                sp_chunk: bool = False) -> tuple[list[PartCost], int, int]:
    """Sum a costed (and maybe tensor-parallel) graph's nodes into its parts; also the
    bytes of head values the repeated layer reads and of the model's outputs; ``fused``:
    activations as Megatron-Core keeps them (``smp_fx.planner.fused``); ``sp_chunk``: op
    by op, but a gathered sequence kept as its chunk, as Megatron-LM keeps it
    (``smp_fx.planner.fused.gathered_surplus``)."""
    parts = split_parts(gm, repeats)
    table = _param_table(gm)
    experts = expert_ids(gm)
    part_of = {n: i for i, nodes in enumerate(parts) for n in nodes}
    readers: dict[int, set[int]] = {}
    names: dict[int, str] = {}
    for n, i in part_of.items():
        for name in meta.PARAMS.get(n, ()) or ():
            if name in table:
                readers.setdefault(table[name][0], set()).add(i)
                names.setdefault(table[name][0], name)
    # the two kept layers read their own tensors: a tie is a tensor of several parts that
    # are not both layers
    counts = {tid: len(ps) for tid, ps in readers.items()}
    head = frozenset(n.name for n in parts[0]) if fused and repeats is not None else \
        frozenset() if fused else None
    out = []
    for i, nodes in enumerate(parts):
        later = {n for n, j in part_of.items() if j > i}
        layer = repeats is not None and 1 <= i <= KEPT
        out.append(_part_cost(nodes, later, layer, table, counts, names, experts, head,
                              sp_chunk))
    relay = 0
    if repeats is not None:
        repeated = set(parts[KEPT])
        relay = sum(_nbytes(n) for n in parts[0] if any(u in repeated for u in n.users))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return out, relay, sum(_nbytes(n) for n in output.all_input_nodes)


def costed(reduced: torch.fx.GraphModule, inputs: Callable[[int], tuple[Any, ...]],
           mbs: int, spec: DeviceSpec) -> torch.fx.GraphModule:
    """``reduced`` with shapes and node costs for one microbatch of ``mbs`` samples: what
    ``profile`` prices at every tp degree and sp of that size, so a caller keeps it for
    them (``shape_prop`` and ``annotate_costs`` were two thirds of a profile's time)."""
    return annotate_costs(shape_prop(reduced, tuple(inputs(mbs))), spec)


def profile(reduced: torch.fx.GraphModule, repeats: Repeats | None,
            inputs: Callable[[int], tuple[Any, ...]], mbs: int, tp: int, sp: bool,
            spec: DeviceSpec, tp_comm: Callable[[float], float] | None,
            marked: tuple[str, ...] = ("",), fused: bool = False,
            graph: torch.fx.GraphModule | None = None, sp_chunk: bool = False) -> Profile:
    """Price ``reduced`` (``smp_fx.planner.layers.keep_layers``, or the whole graph when
    ``repeats`` is None) for one microbatch of ``mbs`` samples (``inputs(mbs)``) at tensor
    parallel degree ``tp`` (Megatron semantics: the tp ranks share the batch; ``marked``
    module paths are sharded, the whole model by default) with ``sp`` sequence
    parallelism; ``tp_comm(bytes)`` is one message on the tensor-parallel link; ``fused``:
    as Megatron-Core runs it (``price_parts``); ``graph``: ``costed(reduced, inputs, mbs,
    spec)`` when the caller has it; ``sp_chunk``: a gathered sequence kept as its chunk
    (``price_parts``)."""
    gm = graph if graph is not None else costed(reduced, inputs, mbs, spec)
    gm, replicated = rank_graph(gm, tp, sp, spec, tp_comm, marked)
    parts, relay, output = price_parts(gm, repeats, fused, sp_chunk)
    if fused:
        parts = [_fused_times(part, nodes, spec)
                 for part, nodes in zip(parts, split_parts(gm, repeats), strict=True)]
    if repeats is None:
        return Profile(mbs, tp, sp, tuple(parts), (0, 1), 0, 0, output, replicated)
    return Profile(mbs, tp, sp, tuple(parts), (KEPT, repeats.count - KEPT + 1),
                   repeats.count, relay, output, replicated)


def rank_graph(gm: torch.fx.GraphModule, tp: int, sp: bool, spec: DeviceSpec,
               tp_comm: Callable[[float], float] | None, marked: tuple[str, ...] = ("",)
               ) -> tuple[torch.fx.GraphModule, tuple[tuple[str, str], ...]]:
    """A costed graph (``costed``) as one tensor-parallel rank of ``tp`` runs it: the
    rewrite's shards, collectives and GEMMs at the shape each runs, and the modules it left
    replicated; ``gm`` itself at tp 1. What ``profile`` sums, and what a caller reads to
    see each node's price (``benchmarks/gemm_shapes.py``: every GEMM's shape and time)."""
    if tp <= 1:
        return gm, ()
    for n in gm.graph.nodes:
        meta.STAGE.set(n, 0)
    out, plan = tensor_parallel(gm, TensorParallelism(tp, 0, True, marked, sp), tp_comm)
    return reprice_gemms(out, spec), tuple(plan.replicated)


def _fused_times(part: PartCost, nodes: list[torch.fx.Node], spec: DeviceSpec) -> PartCost:
    """``part`` with its element-wise ops run as Megatron-Core's fused kernels."""
    fwd, bwd = elementwise_saving(nodes, spec)
    return dataclasses.replace(part, fwd_s=part.fwd_s - fwd, bwd_s=part.bwd_s - bwd)


def model_dtype(precision: str) -> torch.dtype:
    """The dtype a plan's activations and matmuls run in."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


__all__ = ["PERSISTENCE_THRESHOLD", "RECOMPUTE", "PartCost", "Profile", "costed",
           "model_dtype", "price_parts", "profile", "rank_graph", "split_parts"]
