"""Price each GEMM at the shape this rank runs: a tensor-parallel shard's own waves.

Why: ``annotate_costs`` prices a GEMM at its traced shape, wave quantization included
(``cost_model.waves``), and the tensor-parallel rewrite divides that time by the degree,
which keeps the traced shape's waves. A column linear at tp 8 computes an eighth of the
outputs, a row linear an eighth of the contraction: their tiles fill the SMs in another
number of waves. The rewrite records the shard it runs (``meta.GEMM``: (priced, runs));
this pass scales the node's times by the priced shape's wave factors over the shard's and
records it as priced at the shard. The efficiency table is still read at the traced
shape's smallest dimension, as the rewrite's division leaves it.
"""

from __future__ import annotations

import dataclasses

import torch.fx

from cost_model.device import DeviceSpec
from cost_model.waves import gemm_factors
from passes.graph_utils import copy_graph_module
from passes.meta import COST, GEMM


def reprice_gemms(gm: torch.fx.GraphModule, device: DeviceSpec) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose GEMMs are priced with the waves of the shape each runs."""
    out = copy_graph_module(gm)
    for node in out.graph.nodes:
        shapes, cost = GEMM.get(node), COST.get(node)
        if shapes is None or cost is None or shapes[0] == shapes[1]:
            continue
        priced, runs = shapes
        (pf, pb), (rf, rb) = gemm_factors(priced, device), gemm_factors(runs, device)
        COST.set(node, dataclasses.replace(cost, fwd_time_s=cost.fwd_time_s * pf / rf,
                                           bwd_time_s=cost.bwd_time_s * pb / rb))
        GEMM.set(node, (runs, runs))
    return out


__all__ = ["reprice_gemms"]
