"""Regions of checkpointed modules: strategies, stage boundaries, and the memory model."""

from __future__ import annotations

import logging

import pytest
import torch

from cost_model.errors import SMPConfigError, SMPPartitionError
from passes import meta
from passes.checkpoint_regions import Region, region_for
from passes.partition_config import CheckpointRule, PartitionConfig
from passes.pipeline import compile_model
from passes.plan import PartitionPlan
from tests.helpers.memory import STAGE_1_FROM, mlp_stack

CHILDREN = tuple(str(i) for i in range(11))


def _rule(strategy: str, path: str = "") -> CheckpointRule:
    return CheckpointRule(path, strategy, True, CHILDREN)


def test_strategies_group_the_children() -> None:
    assert region_for("3", [_rule("each")]) == Region("3")
    assert region_for("3", [_rule("group_2")]) == Region("[2-3]")
    assert region_for("10", [_rule("group_3")]) == Region("[9-10]")
    assert region_for("3", [_rule("contiguous")]) == Region("<root>", per_stage=True)
    nested = [CheckpointRule("blocks", "group_2", False, ("0", "1", "2")),
              CheckpointRule("blocks.1")]
    assert region_for("blocks.1.attn", nested) == Region("blocks.[0-1]", False)
    assert region_for("head", nested) is None
    assert region_for("blocks.1.attn", [CheckpointRule("blocks.1")]) == Region("blocks.1")
    for bad in ("group_0", "groups", "every"):
        with pytest.raises(SMPConfigError, match="strategy"):
            CheckpointRule("x", bad)


def _compile(rules: tuple[CheckpointRule, ...], auto: bool = True, w: float = 0.8,
             offload: bool = False, batch: int = 4
             ) -> tuple[torch.fx.GraphModule, PartitionPlan]:
    torch.manual_seed(0)
    model = mlp_stack()
    pins = {str(i): int(i >= STAGE_1_FROM) for i in range(len(model))}
    cfg = PartitionConfig(num_stages=2, microbatches=4, memory_weight=w, auto_partition=auto,
                          checkpointing=rules, offload_activations=offload)
    c = compile_model(model, (torch.randn(batch, 16),), None, cfg, device="h100", pins=pins)
    return c.gm, c.plan


def test_contiguous_regions_are_cut_at_the_stage_boundary() -> None:
    gm, plan = _compile((_rule("contiguous"),), auto=False)
    assert [st.checkpointed for st in plan.stages] == [("<root>@0",), ("<root>@1",)]
    for n in gm.graph.nodes:
        if meta.CKPT_REGION.has(n):
            assert meta.CKPT_REGION.get(n).name == f"<root>@{meta.STAGE.get(n)}"


def test_a_split_region_is_an_error_under_manual_partitioning() -> None:
    with pytest.raises(SMPPartitionError, match=r"\[3-5\]"):
        _compile((_rule("group_3"),), auto=False)


def test_a_split_region_is_skipped_with_a_warning_under_auto(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="smp_fx.checkpointing"):
        gm, plan = _compile((CheckpointRule(""),))  # the whole model: always split
    assert "skipped" in caplog.text
    assert not any(meta.CKPT_REGION.has(n) for n in gm.graph.nodes)
    plain_gm, plain = _compile(())
    assert [st.memory for st in plan.stages] == [st.memory for st in plain.stages]


def test_the_memory_model_keeps_inputs_and_adds_recomputation() -> None:
    _, plain = _compile((), auto=False)
    _, each = _compile((_rule("each"),), auto=False)
    _, cont = _compile((_rule("contiguous"),), auto=False)
    _, off = _compile((_rule("contiguous"),), auto=False, offload=True)
    for s in (0, 1):
        p, c, o = plain.stages[s], cont.stages[s], off.stages[s]
        # one region per stage keeps only the stage's input
        assert c.memory.activations_per_microbatch == sum(b.nbytes for b in c.received) or (
            s == 0 and c.memory.activations_per_microbatch == 4 * 16 * 4)
        assert c.memory.activations_per_microbatch < p.memory.activations_per_microbatch
        assert c.memory.recompute_transient > 0
        assert c.recompute_time_s == pytest.approx(p.fwd_time_s)
        assert c.bwd_time_s == pytest.approx(p.bwd_time_s + p.fwd_time_s)
        assert each.stages[s].memory.recompute_transient <= c.memory.recompute_transient
        assert o.memory.activations_per_microbatch == 0
        assert o.memory.offloaded_per_microbatch == c.memory.activations_per_microbatch
    again = PartitionPlan.loads(cont.dumps())
    assert again == cont and again.config.checkpointing == (_rule("contiguous"),)
    assert "checkpointed" not in plain.dumps() and "checkpointing" not in plain.dumps()


def test_the_partitioner_balances_with_checkpointing() -> None:
    """Memory-weighted (w=1), activations dominating: checkpointing the first half moves
    the cut so the stages' memory stays balanced (that stage can hold more layers)."""
    half = (CheckpointRule("", "contiguous", True, CHILDREN[:6]),)
    _, plain = _compile((), w=1.0, batch=512)
    _, ck = _compile(half, w=1.0, batch=512)
    assert len(ck.stages[0].nodes) > len(plain.stages[0].nodes)


@pytest.mark.parametrize("strategy", ["group_3", "each"])
def test_automatic_partitioning_keeps_regions_whole(
        strategy: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="smp_fx.checkpointing"):
        gm, plan = _compile((_rule(strategy),), batch=512, w=1.0)
    assert "skipped" not in caplog.text
    regions = [r for st in plan.stages for r in st.checkpointed]
    assert len(regions) == len(set(regions)) == (4 if strategy == "group_3" else 11)
