"""Experts under expert parallelism: their grouped GEMMs repriced at ep (ep times the rows
per expert, 1/ep of the weights), GPT-OSS's transposed expert layout read right, and
Megatron-Core's expert grid: all-to-alls inside a node at ep 8, the experts' gradients
reduced over the dp / ep ranks holding them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.cluster import get_cluster
from cost_model.collectives import collective_time
from cost_model.roofline import node_times
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.expert_gemm import GroupedGemm, at_ep, ep_change
from smp_fx.planner.model import Profiler
from smp_fx.planner.placement import megatron_expert_span, span
from smp_fx.planner.stages import rank_loads
from smp_fx.planner.step import Setting, exchange_times, price

ROOT = Path(__file__).resolve().parents[3]
GPT_OSS = ROOT / "tests" / "data" / "hf_tiny_gpt_oss" / "config.json"
SEQ, MBS = 32, 2
CLUSTER = get_cluster("dgx-h100")
SPEC = CLUSTER.device


def test_at_ep_runs_ep_times_the_rows_on_a_fraction_of_the_weights() -> None:
    """GPT-OSS 120B's gate_up at one 4096-token sample: 128 experts x 128 rows traced;
    at ep 8 a rank runs 16 experts x 1024 rows and reads 16 experts' weights."""
    flops = 2 * 16384 * 2880 * 5760
    weight, other = 128 * 2880 * 5760 * 2, 16384 * (2880 + 5760) * 2
    f1, b1 = node_times("grouped_mm", SPEC, fwd_flops=flops, bwd_flops=2 * flops,
                        out_elems=0.0, moved=other + weight, dtype="bfloat16", gemm_dim=128)
    g = GroupedGemm(flops, 2 * flops, 128, 2880, 5760, weight, other, "bfloat16", f1, b1)
    assert at_ep(g, 1, SPEC) == (f1, b1)
    fwd, bwd = at_ep(g, 8, SPEC)
    peak = SPEC.peak_flops("bfloat16")
    assert fwd == pytest.approx(max(flops / (peak * SPEC.matmul_fraction(1024)),
                                    (other + weight / 8) / SPEC.bandwidth(other + weight / 8)))
    assert bwd == pytest.approx(2 * fwd)
    assert f1 > 2 * fwd  # traced: the weights' read dominates (memory-bound at 128 rows)
    df, db = ep_change([(g, 9, 9)], 8, SPEC)  # 9 layers, each recomputed once
    assert df == pytest.approx(9 * (fwd - f1)) and db == pytest.approx(9 * (bwd - b1 + fwd - f1))


@pytest.fixture(scope="module")
def gpt_oss() -> tuple[Profiler, dict]:
    pytest.importorskip("transformers")
    import json

    from smp_fx.planner.hf_config import prepare_config

    return Profiler(prepare_config(GPT_OSS, SEQ), CLUSTER), json.loads(GPT_OSS.read_text())


def test_gpt_oss_experts_and_dispatch_read_in_its_transposed_layout(gpt_oss) -> None:
    """gate_up (E, H, 2I), down (E, I, H): a pick carries H = 32 activations, not 2I."""
    profiler, cfg = gpt_oss
    prof = profiler(MBS, 1, False)
    ranks = rank_loads(prof, "none", 1, 1, "interleaved", SPEC, 1.0)
    assert ranks is not None
    picks = MBS * SEQ * cfg["num_experts_per_tok"]
    assert ranks.dispatch == (cfg["num_hidden_layers"] * picks * cfg["hidden_size"] * 2,)
    layer = prof.parts[2].grouped
    assert [(g.rows, g.k, g.n) for g in layer] == [
        (picks // 4, 32, 96), (picks // 4, 48, 32)]
    for g in layer:  # traced: annotate_costs counts the weight twice (input, parameter)
        def at(moved: float, g: GroupedGemm = g) -> tuple[float, float]:
            return node_times("grouped_mm", SPEC, fwd_flops=g.fwd_flops,
                              bwd_flops=g.bwd_flops, out_elems=0.0, moved=moved,
                              dtype=g.dtype, gemm_dim=min(g.rows, g.k, g.n))
        assert (g.fwd_s, g.bwd_s) == pytest.approx(at(g.other_bytes + 2 * g.weight_bytes))
        assert at_ep(g, 1, SPEC) == pytest.approx(at(g.other_bytes + g.weight_bytes))


def test_megatron_expert_grid_spans() -> None:
    """Megatron-Core's order tp-cp-ep-dp-pp: ep 8 of a pp 4 run is one node (SMP's layout,
    pp inside dp, spreads it over four); its edp pairs are 8 ranks apart (two nodes)."""
    c = Candidate(1, 4, 16, 1, 1, "interleaved", "none", False, "zero1", 8)
    assert megatron_expert_span(c, "ep", 8) == (1, 1)
    assert span(c, "ep", 8)[0] == 4
    assert megatron_expert_span(c, "edp", 8) == (2, 8)
    wide = Candidate(1, 1, 64, 4, 1, "interleaved", "none", False, "zero1", 64)
    assert megatron_expert_span(wide, "ep", 8) == (8, 1)


def test_megatron_reduces_the_experts_over_their_holders(gpt_oss) -> None:
    """At dp 4, ep 2 a rank reduce-scatters its dense gradients over dp 4 and its half of
    the experts' over the 2 ranks holding the same half (bf16 gradients)."""
    profiler, _ = gpt_oss
    setting = Setting(CLUSTER, 4, 4 * MBS, runtime="megatron-core", megatron_grads="bf16")
    prof = profiler(MBS, 1, False)
    ranks = rank_loads(prof, "none", 1, 1, "interleaved", SPEC, 1.0)
    assert ranks is not None
    c = Candidate(1, 1, 4, MBS, 1, "interleaved", "none", False, "zero1", 2)
    priced = price(c, ranks, prof, setting)
    fabric = CLUSTER.fabric()
    dense = ranks.elems[0] - ranks.experts[0]
    want = (collective_time("reduce_scatter", dense * 2, 4, fabric).seconds
            + collective_time("reduce_scatter", ranks.experts[0] // 2 * 2, 2, fabric).seconds)
    assert priced.comm.dp == pytest.approx(want)
    ep_s, _ = exchange_times(c, ranks, fabric, "megatron-core")
    one = collective_time("all_to_all", ranks.dispatch[0], 2, fabric)
    assert ep_s == [4 * one.seconds]
