"""The experts' grouped GEMMs as one rank runs them under expert parallelism.

Why: the traced graph runs every expert on one rank, each on tokens x k / E rows, and
reads all E experts' weights. At ep a rank runs its E / ep experts on the picks its ep
group sends them, ep times the rows each under a balanced router, and reads 1/ep of the
weights: the same FLOPs in larger GEMMs (their efficiency by smallest dimension,
``DeviceSpec.matmul_fraction``) and a fraction of the weight traffic. Megatron-Core's
grouped GEMM (``moe_grouped_gemm``) and smp-fx's ``_grouped_mm`` both run the local
experts as one grouped kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch.fx

from cost_model.device import DeviceSpec
from cost_model.roofline import node_times
from passes import meta

OP = "grouped_mm"


@dataclass(frozen=True)
class GroupedGemm:
    """One grouped GEMM of the traced graph: (rows of all groups, k) @ (groups, k, n)."""

    fwd_flops: float
    bwd_flops: float
    rows: int
    """Rows per group (expert) as traced: every expert on one rank."""
    k: int
    n: int
    weight_bytes: int
    """The grouped weight's bytes (all experts)."""
    other_bytes: int
    """The rest of what the kernel moves: its activations in and out."""
    dtype: str
    fwd_s: float
    bwd_s: float
    """Its time as traced (``passes.annotate_costs``, which counts the weight twice: an
    input and a parameter; ``at_ep`` reads it once)."""


def _shape(node: object) -> tuple[int, ...]:
    info = meta.TENSOR.get(node) if isinstance(node, torch.fx.Node) else None
    return tuple(getattr(info, "shape", ()) or ())


def _nbytes(node: object) -> int:
    info = meta.TENSOR.get(node) if isinstance(node, torch.fx.Node) else None
    return int(getattr(info, "nbytes", 0) or 0)


def grouped_gemms(nodes: Sequence[torch.fx.Node]) -> tuple[GroupedGemm, ...]:
    """The grouped GEMMs over a 3-D (experts, k, n) operand among ``nodes``."""
    out = []
    for n in nodes:
        cost = meta.COST.get(n) if meta.COST.has(n) else None
        if cost is None or cost.op != OP or len(n.args) < 2:
            continue
        a, b = _shape(n.args[0]), _shape(n.args[1])
        if len(a) != 2 or len(b) != 3 or not b[0]:
            continue
        weight = _nbytes(n.args[1])
        other = sum(_nbytes(x) for x in n.all_input_nodes if x is not n.args[1]) \
            + _nbytes(n)
        info = meta.TENSOR.get(n)
        out.append(GroupedGemm(cost.fwd_flops, cost.bwd_flops, max(1, a[0] // b[0]), b[1],
                               b[2], weight, other, str(getattr(info, "dtype", "bfloat16")),
                               cost.fwd_time_s, cost.bwd_time_s))
    return tuple(out)


def at_ep(g: GroupedGemm, ep: int, spec: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds of ``g`` on one rank of an ep group (module docstring);
    at ep 1 the traced shapes, the weight read once."""
    return node_times(OP, spec, fwd_flops=g.fwd_flops, bwd_flops=g.bwd_flops,
                      out_elems=0.0, moved=g.other_bytes + g.weight_bytes / ep,
                      dtype=g.dtype, gemm_dim=min(g.rows * ep, g.k, g.n))


def ep_change(gemms: Iterable[tuple[GroupedGemm, int, int]], ep: int, spec: DeviceSpec
              ) -> tuple[float, float]:
    """(forward, backward) seconds one rank's grouped GEMMs change by at ``ep`` against
    their traced times; ``gemms``: (GEMM, forwards run, forwards re-run in the backward
    by recomputation) per microbatch."""
    fwd = bwd = 0.0
    for g, runs, reruns in gemms:
        f, b = at_ep(g, ep, spec)
        fwd += runs * (f - g.fwd_s)
        bwd += runs * (b - g.bwd_s) + reruns * (f - g.fwd_s)
    return fwd, bwd


__all__ = ["GroupedGemm", "at_ep", "ep_change", "grouped_gemms"]
