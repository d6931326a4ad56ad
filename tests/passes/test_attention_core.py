"""The attention core on the graph: an ``sdpa`` node, or a softmax grown out to its two
matmuls; a value other code reads too stays outside; a read off the scores between its
nodes joins it; the regions the runtime recomputes are the ones the planner prices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from passes import meta
from passes.attention_core import attention_cores
from passes.checkpoint_regions import core_regions, mark_regions
from passes.partition_config import ATTENTION_CORE, CheckpointRule, PartitionConfig
from passes.pipeline import analyse, compile_model
from smp_fx.planner.model import Profiler, prepare
from tests.smp_fx.planner.conftest import gpt_inputs, link_cluster, tiny_gpt

SELECTIVE = (CheckpointRule("", ATTENTION_CORE),)


class _Eager(nn.Module):
    """Two layers of Hugging Face style eager attention sharing one additive mask, then a
    gate's softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.ModuleList([nn.Linear(8, 24) for _ in range(2)])
        self.drop = nn.Dropout(0.1)
        self.router = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        mask = torch.triu(torch.full((s, s), -1e4), diagonal=1)  # read by both layers
        for qkv in self.qkv:
            q, k, v = qkv(x).split(8, dim=-1)
            scores = torch.matmul(q, k.transpose(-1, -2)) / 8**0.5 + mask
            probs = torch.softmax(scores, dim=-1).to(scores.dtype)  # a read off the core
            x = x + torch.matmul(self.drop(probs), v)
        return x * torch.softmax(self.router(x), dim=-1)  # a softmax that is no core


def _ops(nodes: list[torch.fx.Node]) -> list[str]:
    return [str(getattr(meta.COST.get(n), "op", n.op)) for n in nodes]


def test_an_eager_core_is_the_chain_between_its_matmuls() -> None:
    gm = analyse(_Eager(), (torch.randn(2, 5, 8),), device="a100")
    cores = attention_cores(list(gm.graph.nodes))
    assert [_ops(c) for c in cores] == [
        ["matmul", "truediv", "add", "softmax", "getattr", "to", "dropout", "matmul"]] * 2
    mask = next(n for n in gm.graph.nodes if _ops([n]) == ["triu"])
    assert all(mask not in c for c in cores)


def test_an_sdpa_node_is_a_core_and_each_core_a_region() -> None:
    gm = analyse(tiny_gpt(2), gpt_inputs(2), device="a100")
    regions = core_regions(list(gm.graph.nodes), SELECTIVE)
    assert sorted(regions) == ["h.0.attn.attention_core", "h.1.attn.attention_core"]
    assert all(_ops(nodes) == ["sdpa"] for _, nodes in regions.values())
    # nested rules find a core once; a module checkpointed whole keeps its core inside
    # its own region
    assert core_regions(list(gm.graph.nodes), (CheckpointRule("h", ATTENTION_CORE),
                                                *SELECTIVE)).keys() == regions.keys()
    marked = mark_regions(gm, (CheckpointRule("h.0"), *SELECTIVE))
    names = {meta.CKPT_REGION.get(n).name for n in marked.graph.nodes
             if meta.CKPT_REGION.has(n)}
    assert names == {"h.0", "h.1.attn.attention_core"}


def test_the_plan_keeps_what_the_planner_prices_selective() -> None:
    """One stage, the whole tiny GPT: the plan's bytes per microbatch and recompute time
    with every core recomputed are the planner's (``PartCost.kept("selective")``)."""
    model, cluster = tiny_gpt(5), link_cluster()
    plans = [compile_model(model, gpt_inputs(3), None,
                           PartitionConfig(num_stages=1, checkpointing=rules),
                           device=cluster.device).plan.stages[0] for rules in ((), SELECTIVE)]
    units = Profiler(prepare(model, gpt_inputs), cluster)(3, 1, False).units()
    plain, selective = plans
    assert selective.memory.activations_per_microbatch == sum(
        u.kept("selective")[0] for u in units) < plain.memory.activations_per_microbatch
    assert len(selective.checkpointed) == 5
    recompute = sum(u.times("selective")[1] - u.bwd_s for u in units)
    assert selective.recompute_time_s == pytest.approx(recompute, rel=1e-9)
    assert selective.bwd_time_s - plain.bwd_time_s == pytest.approx(recompute, rel=1e-6)
