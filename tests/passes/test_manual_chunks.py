"""manual_chunks: rank pins cut into chunks in execution order; the placement they give."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cost_model.errors import SMPConfigError, SMPPartitionError
from passes import meta
from passes.assign_manual import assign_manual
from passes.manual_chunks import manual_chunks
from passes.partition_config import PartitionConfig
from passes.pipeline import compile_model
from tests.passes.partitioning.graphs import annotate


def _mlp(n: int = 8) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])


def _chunks(model: nn.Module, pins: dict[str, int], ranks: int, v: int
            ) -> tuple[dict[str, int], tuple[int, ...]]:
    gm = annotate(model, torch.zeros(2, 8))
    ranked = assign_manual(gm, pins, 0, ranks, check_forward=False)
    out, placement = manual_chunks(ranked, ranks, v)
    return {n.name: meta.STAGE.get(n) for n in out.graph.nodes}, placement


def test_alternating_pins_give_round_robin() -> None:
    pins = {str(i): (i // 2) % 2 for i in range(8)}  # layers 0-1 on 0, 2-3 on 1, 4-5 on 0
    stage, placement = _chunks(_mlp(), pins, 2, 2)
    assert placement == (0, 1, 0, 1)
    assert [stage[f"_{i}"] for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert stage["input_1"] == 0 and stage["output"] == 3


def test_contiguous_pins_are_cut_into_balanced_neighbours() -> None:
    pins = {str(i): i // 4 for i in range(8)}
    stage, placement = _chunks(_mlp(), pins, 2, 2)
    assert placement == (0, 0, 1, 1)
    assert [stage[f"_{i}"] for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_the_order_the_pins_dictate_is_kept() -> None:
    # rank 1 first, then rank 0, then rank 1 again: chunk 0 on rank 1
    pins = {"0": 1, "1": 1, "2": 0, "3": 0, "4": 0, "5": 0, "6": 1, "7": 1}
    stage, placement = _chunks(_mlp(), pins, 2, 2)
    assert placement == (1, 0, 0, 1)
    assert [stage[f"_{i}"] for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_more_runs_than_chunks_keep_a_chunk_per_run() -> None:
    pins = {str(i): i % 2 for i in range(8)}  # four runs per rank
    stage, placement = _chunks(_mlp(), pins, 2, 2)
    assert placement == (0, 1) * 4
    assert [stage[f"_{i}"] for i in range(8)] == list(range(8))


def test_modules_that_come_back_to_a_rank_become_its_chunks() -> None:
    # AWS's GPT-2 notebook: layers pinned 0, 0, 1, 1; the head falls back to rank 0
    pins = {"0": 0, "1": 0, "2": 1, "3": 1, "4": 0}
    stage, placement = _chunks(_mlp(5), pins, 2, 1)
    assert placement == (0, 1, 0)
    assert [stage[f"_{i}"] for i in range(5)] == [0, 0, 1, 1, 2]
    assert stage["output"] == 2


def test_a_rank_without_modules_is_named() -> None:
    with pytest.raises(SMPPartitionError, match=r"rank 1: no module pinned.*partition 1"):
        _chunks(_mlp(3), {"0": 0, "1": 2, "2": 0}, 3, 1)


def test_a_rank_with_too_few_layers_is_a_config_error() -> None:
    with pytest.raises(SMPConfigError, match="needs 3 chunks on each rank.*rank 1"):
        _chunks(_mlp(4), {"0": 0, "1": 0, "2": 0, "3": 1}, 2, 3)


def test_a_manual_plan_records_its_placement() -> None:
    model = _mlp()
    cfg = PartitionConfig(num_stages=2, microbatches=4, pipeline="interleaved",
                          virtual_stages=2, auto_partition=False)
    plan = compile_model(model, (torch.zeros(4, 8),), None, cfg,
                         pins={str(i): i // 4 for i in range(8)}).plan
    assert plan.placement == (0, 0, 1, 1)
    assert [r.chunks for r in plan.ranks] == [(0, 1), (2, 3)]
    # chunk 0 hands over to chunk 1 on rank 0: no link; chunk 1 sends to rank 1
    assert plan.stages[0].link_time_s == 0.0 < plan.stages[1].link_time_s


@pytest.mark.parametrize("pipeline", ["simple", "interleaved", "zero_bubble"])
def test_a_plan_that_comes_back_is_chunked_at_v1(pipeline: str) -> None:
    cfg = PartitionConfig(num_stages=2, microbatches=4, pipeline=pipeline,
                          auto_partition=False)
    pins = {"0": 0, "1": 0, "2": 1, "3": 1, "4": 0}
    plan = compile_model(_mlp(5), (torch.zeros(4, 8),), None, cfg, pins=pins).plan
    assert plan.placement == (0, 1, 0)
    assert [r.chunks for r in plan.ranks] == [(0, 2), (1,)]
    assert 0.0 < plan.bubble_fraction < 1.0


def test_a_plan_that_goes_forward_stays_one_stage_per_rank() -> None:
    cfg = PartitionConfig(num_stages=2, microbatches=4, auto_partition=False)
    plan = compile_model(_mlp(4), (torch.zeros(4, 8),), None, cfg,
                         pins={"0": 0, "1": 0, "2": 1, "3": 1}).plan
    assert plan.placement == () and plan.ranks == ()
