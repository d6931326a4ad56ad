"""The model the planner prices: traced once, its layers found, its parts priced on demand.

Why: tracing a 1T-parameter GPT takes a couple of seconds on the meta device; pricing its
parts takes a tenth of a second per (microbatch size, tp degree, sequence parallelism).
``prepare`` traces once and keeps two layers (``smp_fx.planner.layers``); ``Profiler``
prices the reduced graph for each setting the search asks for, once
(``smp_fx.planner.profile``), on the cluster's device and tensor-parallel link.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from cost_model.cluster import ClusterSpec
from cost_model.collectives import bus_bandwidth
from cost_model.device import DeviceSpec
from cost_model.gpu_specs import with_te_attention
from passes.fp8_linears import mark_fp8_linears
from passes.trace import Frontend, trace
from smp_fx.planner.layers import Repeats, find_repeats, keep_layers, tidy
from smp_fx.planner.overlap import MEGATRON_CORE, MEGATRON_LM, SMP_FX
from smp_fx.planner.profile import Profile, costed, profile

Inputs = Callable[[int], tuple[Any, ...]]


@dataclass(frozen=True)
class ModelInfo:
    """What the plan reports of the model."""

    name: str
    parameters: int
    layers: int
    layer_path: str
    tokens_per_sample: int
    nodes: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "parameters": self.parameters, "layers": self.layers,
                "layer_path": self.layer_path, "tokens_per_sample": self.tokens_per_sample,
                "graph_nodes": self.nodes}


@dataclass(frozen=True)
class Prepared:
    """The traced model reduced for pricing (``graph``), its layers and inputs."""

    graph: torch.fx.GraphModule
    repeats: Repeats | None
    inputs: Inputs
    info: ModelInfo


def parameter_count(model: nn.Module) -> int:
    """Trainable elements, tied tensors once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            total += p.numel()
    return total


TRACE_BATCH = 2
"""Samples the model is traced on: ``torch.export`` fixes a batch dimension of size 1 in
some models (a Hugging Face Llama's attention views), and the planner prices microbatches
of every size on the one graph."""


def prepare(model: nn.Module, inputs: Inputs, name: str = "model",
            frontend: Frontend = "auto") -> Prepared:
    """Trace ``model`` (on the meta device, typically), find its repeated layers and keep
    two (the whole graph when it has none). ``auto``: fx, or ``torch.export`` where fx
    would hide modules in automatic leaves (a Hugging Face model's decoder stack)."""
    sample = inputs(1)
    gm = tidy(trace(model, tuple(inputs(TRACE_BATCH)), None, frontend))
    repeats = find_repeats(gm)
    reduced = keep_layers(gm, repeats) if repeats is not None else gm
    first = next((x for x in sample if isinstance(x, torch.Tensor)), None)
    tokens = int(first.numel()) if first is not None else 1
    info = ModelInfo(name, parameter_count(model), repeats.count if repeats else 0,
                     f"{repeats.parent}.N" if repeats else "", tokens, len(gm.graph.nodes))
    return Prepared(reduced, repeats, inputs, info)


class Profiler:
    """``Profile``s of a prepared model on a cluster, each priced once (module docstring)."""

    def __init__(self, prepared: Prepared, cluster: ClusterSpec,
                 marked: tuple[str, ...] = ("",), runtime: str = SMP_FX,
                 fp8: bool = False) -> None:
        self.prepared = prepared
        self.cluster = cluster
        self.marked = marked
        self.runtime = runtime
        """Whose runtime runs the plans (``Setting.runtime``): what activations it keeps."""
        self.device: DeviceSpec = (with_te_attention(cluster.device)
                                   if runtime == MEGATRON_CORE else cluster.device)
        """The spec ops are priced on: Megatron-Core's runs take Transformer Engine's
        attention (``cost_model.gpu_specs.with_te_attention``)."""
        self.fp8 = fp8
        """The repeated layers' linears run in FP8 (``Setting.fp8``)."""
        self._graph = prepared.graph
        """What is costed: the reduced graph, its layers' linears marked when ``fp8``."""
        if fp8:
            self.device.peak_flops("float8")  # a GPU without FP8 tensor cores: said now
            self._graph = mark_fp8_linears(
                prepared.graph, prepared.repeats.parent if prepared.repeats else "")
        self._cache: dict[tuple[int, int, bool], Profile] = {}
        self._costed: dict[int, torch.fx.GraphModule] = {}

    def tp_comm(self, tp: int) -> Callable[[float], float]:
        """One message of a tp ring: NVLink inside a node, the network beyond one."""
        fabric = self.cluster.fabric()
        nodes = math.ceil(tp / self.cluster.gpus_per_node)
        if nodes <= 1:
            lat, bw = fabric.intra_latency_s, fabric.intra_bandwidth
        else:
            lat, bw = fabric.inter_latency_s, bus_bandwidth(fabric, tp, nodes)

        def comm(nbytes: float) -> float:
            return lat + nbytes / bw if nbytes > 0 else 0.0

        return comm

    def __call__(self, mbs: int, tp: int, sp: bool) -> Profile:
        key = (mbs, tp, sp)
        if key not in self._cache:
            p = self.prepared
            self._cache[key] = profile(p.graph, p.repeats, p.inputs, mbs, tp, sp,
                                       self.device, self.tp_comm(tp), self.marked,
                                       self.runtime == MEGATRON_CORE, self.costed(mbs),
                                       self.runtime == MEGATRON_LM)
        return self._cache[key]

    def costed(self, mbs: int) -> torch.fx.GraphModule:
        """The reduced graph costed at ``mbs`` samples, made once and shared by every tp
        degree and sp priced at that size (``smp_fx.planner.profile.costed``)."""
        if mbs not in self._costed:
            self._costed[mbs] = costed(self._graph, self.prepared.inputs, mbs, self.device)
        return self._costed[mbs]

    @property
    def priced(self) -> int:
        return len(self._cache)


__all__ = ["TRACE_BATCH", "Inputs", "ModelInfo", "Prepared", "Profiler", "parameter_count",
           "prepare"]
