"""The search keeps to what the runtime runs: candidates with ep or cp > 1 that smp.init
refuses are left out and counted (priced, marked, only as ``--fix`` what-ifs), a sequence
cp cannot cut is skipped with its reason, and a cp group spanning nodes unevenly is priced
on the network instead of stopping the search."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cost_model.cluster import get_cluster
from smp_fx.cli.plan_render import format_plans
from smp_fx.planner import search as search_module
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.model import Prepared
from smp_fx.planner.placement import span
from smp_fx.planner.planner import plan
from smp_fx.planner.smp_config import refusal
from smp_fx.planner.step import Setting

LLAMA = Path(__file__).resolve().parents[3] / "tests" / "data" / "hf_tiny_llama"
SEQ = 48  # cuts into 2 x cp chunks for cp 1, 2, 3, 4, 6
CLUSTER = get_cluster("dgx-h100")
SMALL = {"mbs": 1, "recompute": "none"}


@pytest.fixture(scope="module")
def llama() -> Prepared:
    pytest.importorskip("transformers")
    from smp_fx.planner.hf_config import prepare_config

    return prepare_config(LLAMA, SEQ)


def test_cp3_over_two_nodes_is_priced_on_the_network(llama) -> None:
    fixed = {**SMALL, "tp": 1, "pp": 1, "cp": 3, "zero": "none"}
    best = plan(llama, Setting(CLUSTER, 12, 12), fixed=fixed, top_k=1).best
    assert (best.cp, best.dp) == (3, 4)
    assert span(best.candidate, "cp", 8) == (2, 1)  # ranks 6, 7 | 8 straddle two nodes
    one_node = dataclasses.replace(CLUSTER, gpus_per_node=16)
    inside = plan(llama, Setting(one_node, 12, 12), fixed=fixed, top_k=1).best
    assert best.details["comm"]["cp_s"] > inside.details["comm"]["cp_s"] > 0


def test_no_refused_combination_is_ranked(llama) -> None:
    setting = Setting(CLUSTER, 8, 8)
    planned = plan(llama, setting, fixed=SMALL, top_k=10**6)
    res = planned.result
    assert all(refusal(r.candidate, 8, "bf16") is None for r in planned.records)
    counted = sum(n for why, n in res.refused.items() if why.startswith("smp.init refuses"))
    assert counted == res.runtime_refused
    assert {r.cp for r in planned.records} >= {1, 2}


def test_refusals_are_left_out_counted_and_priced_only_as_fixed_what_ifs(llama, monkeypatch
                                                                          ) -> None:
    def no_cp_with_dp(c: Candidate, batch: int, precision: str) -> str | None:
        return "cp with dp (got 2)" if c.cp > 1 and c.dp > 1 else None

    monkeypatch.setattr(search_module, "refusal", no_cp_with_dp)
    setting = Setting(CLUSTER, 8, 8)
    fixed = {**SMALL, "tp": 1, "pp": 1}
    planned = plan(llama, setting, fixed=fixed, top_k=10**6)
    assert {(r.cp, r.dp) for r in planned.records} == {(1, 8), (8, 1)}
    assert planned.result.runtime_refused == planned.result.refused["smp.init refuses cp with dp"]
    assert planned.result.runtime_refused > 0 and "smp.init refuses" in format_plans(planned)
    what_if = plan(llama, setting, fixed={**fixed, "cp": 2}, top_k=10**6)
    assert what_if.records and all(r.details["refused"] == "cp with dp" for r in what_if.records)
    assert "is a what-if (--fix)" in format_plans(what_if)


def test_a_sequence_cp_cannot_cut_is_skipped_with_the_runtime_s_reason(llama) -> None:
    planned = plan(llama, Setting(CLUSTER, 16, 16), fixed={**SMALL, "tp": 1, "pp": 1},
                   top_k=10**6)
    assert 16 not in {r.cp for r in planned.records}  # 48 tokens are not 32 chunks
    assert 8 in {r.cp for r in planned.records}
    assert any(why.startswith("cp 16:") and "multiple of 32" in why
               for why in planned.result.refused)


def test_megatron_core_runs_only_splits_that_divide_the_layers(llama) -> None:
    """Its four layers over pp 3 leave a remainder: Megatron-Core does not build that
    (get_num_layers_to_build, and its arguments' check); smp-fx's own runtime does."""
    fixed = {**SMALL, "tp": 1, "cp": 1, "ep": 1}
    core = plan(llama, Setting(CLUSTER, 12, 12, runtime="megatron-core"), fixed=fixed,
                top_k=10**6)
    mine = plan(llama, Setting(CLUSTER, 12, 12), fixed=fixed, top_k=10**6)
    assert 3 in {r.pp for r in mine.records} and 3 not in {r.pp for r in core.records}
    assert core.result.refused.get(
        "Megatron-Core splits the 4 layers evenly: pp x vp = 3 chunks do not divide them")
    assert {r.pp for r in core.records} == {1, 2, 4}
