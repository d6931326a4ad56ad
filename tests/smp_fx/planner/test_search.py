"""The search: ranked, fitting, fixable, and clear about what it cannot do."""

from __future__ import annotations

import dataclasses

import pytest

from cost_model.collectives import collective_time
from cost_model.errors import SMPConfigError
from smp_fx.planner.candidate import Candidate, parse_fix
from smp_fx.planner.model import Profiler, prepare
from smp_fx.planner.planner import plan
from smp_fx.planner.search import check_fixed, schedule_options, search
from smp_fx.planner.stages import rank_loads
from smp_fx.planner.step import FP8_WEIGHT_BYTES, Setting, price
from tests.smp_fx.planner.conftest import gpt_inputs, link_cluster, tiny_gpt


@pytest.fixture(scope="module")
def prepared():
    return prepare(tiny_gpt(8), gpt_inputs)


def test_ranked_and_fitting(prepared) -> None:
    setting = Setting(link_cluster(), 8, 32, "bf16")
    planned = plan(prepared, setting, top_k=6)
    steps = [r.step_time_s for r in planned.records]
    assert steps == sorted(steps) and len(steps) == 6
    assert all(r.memory_bytes_per_gpu <= setting.cluster.usable_memory_bytes
               for r in planned.records)
    for r in planned.records:
        assert r.tp * r.pp * r.cp * r.dp == 8 and r.dp * r.mbs * r.microbatches == 32
    assert planned.result.considered >= planned.result.fitting >= 6
    assert "faster than the runner-up" in planned.reason


def test_a_fixed_plan_prices_as_the_search_priced_it(prepared) -> None:
    setting = Setting(link_cluster(), 8, 32, "bf16")
    planned = plan(prepared, setting, top_k=3)
    for rec in planned.records:
        again = plan(prepared, setting, fixed=parse_fix(rec.fix_text()), top_k=1)
        assert again.result.considered == 1
        assert again.best.step_time_s == rec.step_time_s
        assert again.best.memory_bytes_per_gpu == rec.memory_bytes_per_gpu


def test_fix_prunes_the_space(prepared) -> None:
    setting = Setting(link_cluster(), 8, 32, "bf16")
    planned = plan(prepared, setting, fixed={"tp": 2, "recompute": "full"}, top_k=20)
    assert {(r.tp, r.recompute) for r in planned.records} == {(2, "full")}


def test_allowed_refuses_with_reasons(prepared) -> None:
    setting = Setting(link_cluster(), 8, 32, "bf16")

    def only_1f1b(c: Candidate) -> str | None:
        return None if c.schedule == "interleaved" and c.vp == 1 else "not 1F1B"

    planned = plan(prepared, setting, allowed=only_1f1b, top_k=20)
    assert {(r.schedule, r.vp) for r in planned.records} == {("interleaved", 1)}
    assert planned.result.refused["not 1F1B"] > 0


def test_nothing_fits_says_how_much_and_what_would(prepared) -> None:
    setting = Setting(link_cluster(memory_gib=0.0005), 2, 8, "fp32")
    with pytest.raises(SMPConfigError, match="no plan fits in GPU memory") as err:
        plan(prepared, setting)
    text = str(err.value)
    assert "needs" in text and "GiB per GPU" in text and "Fix: try" in text
    assert "GPU with at least" in text


@pytest.mark.parametrize("fixed, message", [
    ({"tp": 3}, "tp divides the GPU count"),
    ({"tp": 2, "pp": 2, "dp": 4}, "tp x pp x cp x dp equals the GPU count"),
    ({"tp": 1, "pp": 2, "cp": 2, "dp": 1}, "tp x pp x cp x dp equals the GPU count"),
    ({"cp": 3}, "cp divides the GPU count"),
    ({"ep": 4, "dp": 2}, "ep divides dp"),
    ({"dp": 8, "mbs": 3}, "microbatch size divides"),
    ({"pp": 4, "vp": 4}, "each hold a layer"),
    ({"sp": True, "tp": 1}, "sequence parallelism needs tp > 1"),
    ({"zero": "zero1", "dp": 1}, "sharding needs data parallelism"),
    ({"schedule": "zbv", "vp": 3}, "zbv runs two chunks"),
])
def test_impossible_fixes_rejected(fixed, message) -> None:
    with pytest.raises(SMPConfigError, match=message):
        check_fixed(fixed, 8, 32, 8)


def test_bad_fix_text_rejected() -> None:
    for text, message in (("tp=0", "integer >= 1"), ("foo=1", "keys tp"),
                          ("schedule=pipedream", "schedule is one of"), ("sp=maybe", "sp takes"),
                          ("tp", "KEY=VALUE")):
        with pytest.raises(SMPConfigError, match=message):
            parse_fix(text)


def test_schedule_options() -> None:
    assert list(schedule_options(1, 8, 8)) == [("interleaved", 1)]
    opts = list(schedule_options(2, 8, 8))
    assert ("zbv", 2) in opts and ("interleaved", 4) in opts and ("simple", 1) in opts
    assert ("interleaved", 8) not in opts  # 16 chunks for 8 layers
    assert ("interleaved", 2) not in list(schedule_options(4, 6, 16))  # m % p


def test_more_microbatches_shrink_the_bubble(prepared) -> None:
    setting = Setting(link_cluster(), 4, 64, "bf16")
    prof = Profiler(prepared, setting.cluster)
    bubbles = []
    for mbs in (16, 4, 1):
        c = Candidate(1, 4, 1, mbs, 1, "interleaved", "none", False, "none")
        ranks = rank_loads(prof(mbs, 1, False), "none", 4, 1, "interleaved",
                           setting.cluster.device)
        bubbles.append(price(c, ranks, prof(mbs, 1, False), setting).bubble_fraction)
    assert bubbles[0] > bubbles[1] > bubbles[2]


def test_data_parallel_reduction_is_priced_on_the_network(prepared) -> None:
    base = link_cluster(gpus_per_node=2)
    slow = dataclasses.replace(base, inter_node_bandwidth=base.inter_node_bandwidth / 100)
    fixed = {"tp": 1, "pp": 1, "dp": 8, "mbs": 1, "zero": "none", "recompute": "none"}
    fast_plan = plan(prepared, Setting(base, 8, 32, "bf16"), fixed=fixed).best
    slow_plan = plan(prepared, Setting(slow, 8, 32, "bf16"), fixed=fixed).best
    for cluster, got in ((base, fast_plan), (slow, slow_plan)):
        grads = got.details["memory"]["grads"]  # bf16: fp32 gradients, reduced as they are
        # 8 ranks, 2 per node: 4 nodes, one group on each
        want = collective_time("all_reduce", grads, 8, cluster.fabric(), nodes=4).seconds
        assert got.details["comm"]["dp_s"] == pytest.approx(want, rel=1e-5)
    assert slow_plan.details["comm"]["dp_s"] > 5 * fast_plan.details["comm"]["dp_s"]
    assert slow_plan.step_time_s > fast_plan.step_time_s


def test_search_covers_the_space_without_fixes(prepared) -> None:
    setting = Setting(link_cluster(), 8, 16, "bf16")
    result = search(Profiler(prepared, setting.cluster), setting, top_k=1000)
    seen = {(p.candidate.schedule, p.candidate.vp > 1, p.candidate.recompute,
             p.candidate.zero, p.candidate.sp) for p in result.ranked}
    assert {s for s, *_ in seen} == {"simple", "interleaved", "zero_bubble", "zbv"}
    assert {z for *_, z, _ in seen} == {"none", "zero1", "fsdp"}
    assert {r for _, _, r, _, _ in seen} == {"none", "selective", "full"}


def test_fp8_linears_price_large_gemms_faster_and_tiny_ones_slower() -> None:
    """Large GEMMs run at twice the rate; a tiny model's memory-bound GEMMs gain nothing
    and pay for their casts."""
    import functools

    import torch

    from cost_model.cluster import get_cluster
    from examples.models import gpt

    h100 = get_cluster("dgx-h100")
    with torch.device("meta"):
        wide = gpt.build_model(n_layer=3, n_embd=2048, n_head=16, vocab_size=64,
                               seq_len=1024).to(torch.bfloat16)
    for model, faster in ((prepare(wide, functools.partial(gpt.example_inputs, seq_len=1024,
                                                              vocab_size=64)), True),
                          (prepare(tiny_gpt(4).to(torch.bfloat16), gpt_inputs), False)):
        fixed = {"tp": 1, "pp": 1, "mbs": 4}
        bf16 = plan(model, Setting(h100, 8, 64), fixed=fixed, top_k=1).best
        fp8 = plan(model, Setting(h100, 8, 64, fp8=True), fixed=fixed, top_k=1).best
        assert fp8.candidate == bf16.candidate
        assert (fp8.step_time_s < 0.8 * bf16.step_time_s) if faster else (
            fp8.step_time_s > bf16.step_time_s)
        assert fp8.mfu == pytest.approx(fp8.model_tflops_per_gpu * 1e12 / 1979e12, rel=1e-3)
    # Transformer Engine's FP8 weight copies (and their transposes): 2 bytes a layer
    # element on every layer a rank holds, one unit's under FSDP
    for zero, layers in (("zero1", 4), ("fsdp", 1)):
        fixed = {"tp": 1, "pp": 1, "mbs": 4, "zero": zero}
        planned = plan(model, Setting(h100, 8, 64, fp8=True), fixed=fixed, top_k=1)
        one = planned.profiler(4, 1, False).parts[2].param_elems  # one layer's
        bf16 = plan(model, Setting(h100, 8, 64), fixed=fixed, top_k=1).best
        params = [r.details["memory"]["params"] for r in (planned.best, bf16)]
        assert params[0] - params[1] == FP8_WEIGHT_BYTES * one * layers, zero
        # FP8 parameters: no copy of the weights in the model's precision (fp32 here, as
        # smp-fx's runtime holds them under bf16 autocast)
        kept = plan(model, Setting(h100, 8, 64, fp8=True, fp8_params=True), fixed=fixed,
                    top_k=1).best.details["memory"]["params"]
        assert kept - params[1] == (FP8_WEIGHT_BYTES - 4) * one * layers, zero
    with pytest.raises(SMPConfigError, match="FP8 parameters are the weights of FP8"):
        Setting(h100, 8, 64, fp8_params=True)
    with pytest.raises(SMPConfigError, match="counted as layers by Megatron-Core's split"):
        Setting(h100, 8, 64, split_ends=True)
    with pytest.raises(SMPConfigError, match="FP8 tensor cores"):
        Profiler(model, get_cluster("dgx-a100-80gb"), fp8=True)
    with pytest.raises(Exception, match="fp8=setting.fp8"):
        plan(model, Setting(h100, 8, 64, fp8=True), profiler=Profiler(model, h100))
