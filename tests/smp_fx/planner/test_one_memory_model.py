"""``smp-fx plan --fix`` and ``smp-fx partition`` count one configuration's model state
alike: the planner's per-rank parameters, gradients and optimizer state (masters and
Adam's step counters included) equal the partition plan's for the SMP configuration the
plan emits, at every precision and sharding (``cost_model.memory.model_state``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from passes.pipeline import compile_model
from smp_fx.config import load_config
from smp_fx.planner import profile
from smp_fx.planner.model import Prepared, prepare
from smp_fx.planner.planner import plan
from smp_fx.planner.smp_config import smp_config
from smp_fx.planner.step import Setting, memory_by_rank
from tests.smp_fx.planner.conftest import gpt_inputs, link_cluster, tiny_gpt

THRESHOLD = 2000
"""A persistence threshold below the tiny GPT's larger tensors, so FSDP shards some."""


@pytest.fixture(scope="module")
def model_and_prepared() -> tuple[torch.nn.Module, Prepared]:
    model = tiny_gpt(4)
    return model, prepare(model, gpt_inputs)


def _partition_state(model: torch.nn.Module, cfg_dict: dict[str, Any],
                     layers: Sequence[int]) -> list[tuple[int, int, int]]:
    """Per stage, the partition plan's (params, grads, optimizer) for SMP's ``cfg_dict``
    with the planner's layers per rank pinned (dp 2)."""
    cfg = load_config({**cfg_dict, "sdp_param_persistence_threshold": THRESHOLD}, env={})
    pconfig = cfg.partition_config("a100", data_parallel_degree=2)
    first = layers[0]
    pins = {"wte": 0, "wpe": 0, "ln_f": 1, "lm_head": 1}
    pins.update({f"h.{i}": 0 if i < first else 1 for i in range(sum(layers))})
    compiled = compile_model(model, gpt_inputs(1), None, pconfig, device=link_cluster().device,
                             pins=pins)
    return [(s.memory.params, s.memory.grads, s.memory.optimizer_state)
            for s in compiled.plan.stages]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("zero", ["none", "zero1", "fsdp"])
def test_plan_fix_and_partition_count_the_same_state(
        model_and_prepared: tuple[torch.nn.Module, Prepared], monkeypatch: pytest.MonkeyPatch,
        precision: str, zero: str) -> None:
    monkeypatch.setattr(profile, "PERSISTENCE_THRESHOLD", THRESHOLD)
    model, prepared = model_and_prepared
    setting = Setting(link_cluster(), 4, 4, precision)
    planned = plan(prepared, setting, fixed={"tp": 1, "pp": 2, "dp": 2, "mbs": 1, "vp": 1,
                                             "schedule": "interleaved", "recompute": "none",
                                             "sp": False, "zero": zero})
    best = planned.best
    c = best.candidate
    ranks = planned.ranks(c)
    by_rank = memory_by_rank(c, ranks, planned.profiler(c.mbs, c.tp, c.sp), setting)
    planner = [(m.params, m.grads, m.optimizer) for m in by_rank]
    partition = _partition_state(model, smp_config(best, precision), ranks.layers)
    assert partition == planner
    if zero != "none":  # the sharding is seen, not a no-op
        whole = memory_by_rank(dataclasses.replace(c, zero="none"), ranks,
                               planned.profiler(c.mbs, c.tp, c.sp), setting)
        assert all(sum(s) < w.state for s, w in zip(partition, whole))
