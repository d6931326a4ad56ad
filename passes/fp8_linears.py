"""FP8 linears: mark the weight GEMMs a run does in FP8, so the cost model prices them so.

Transformer Engine's FP8 recipes (NeMo's and Megatron-Bridge's ``fp8`` runs) do the three
GEMMs of every linear inside the transformer layers in FP8 (forward, input gradient,
weight gradient), and everything else in the model's own precision: attention's core, the
element-wise work, and the layers outside the repeated stack (the embedding, the output
layer, which Megatron-Core builds from its own linear, not Transformer Engine's). The
values stay in their dtype between ops, so the graph is not changed: each such node gets
``meta.GEMM_DTYPE`` = ``"float8"``, which ``passes.annotate_costs`` reads.
"""

from __future__ import annotations

import torch.fx

from passes import meta
from passes.annotate_costs import op_name
from passes.graph_utils import copy_graph_module

FP8 = "float8"
WEIGHT_GEMMS = frozenset({"linear", "addmm", "mm", "matmul"})
"""The ops that are a linear's GEMM when they read a parameter."""


def is_weight_gemm(node: torch.fx.Node, op: str) -> bool:
    """Whether ``node`` (of op name ``op``) multiplies by a parameter: a linear's GEMM."""
    return node.op in ("call_function", "call_module") and op in WEIGHT_GEMMS and bool(
        meta.PARAMS.get(node))


def mark_fp8_linears(gm: torch.fx.GraphModule, within: str) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose weight GEMMs under module path ``within`` (the repeated
    layers' parent, ``smp_fx.planner.layers.Repeats.parent``; ``""``: every one) are
    marked to run in FP8; the count marked is in ``gm.meta["smp.fp8_linears"]``."""
    out = copy_graph_module(gm)
    prefix = f"{within}." if within else ""
    marked = 0
    for node in out.graph.nodes:
        path = meta.MODULE_PATH.get(node) or ""
        if (path + ".").startswith(prefix) and is_weight_gemm(node, op_name(node, out)):
            meta.GEMM_DTYPE.set(node, FP8)
            marked += 1
    out.meta["smp.fp8_linears"] = marked
    return out


__all__ = ["FP8", "WEIGHT_GEMMS", "is_weight_gemm", "mark_fp8_linears"]
