"""benchmarks/plan_validation.py: its data file parses, every row is sourced, rows price."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_validation as pv  # noqa: E402

from cost_model.cluster import GPU_TYPE, get_cluster  # noqa: E402
from cost_model.errors import SMPError  # noqa: E402
from cost_model.gpu_specs import with_attention  # noqa: E402


def test_every_row_parses_and_names_its_source() -> None:
    runs = pv.read_runs()
    assert len({r.id for r in runs}) == len(runs) >= 45
    for r in runs:
        assert len(r.source) > 30 and r.gpu == GPU_TYPE[r.cluster], r.id
        assert r.tp * r.pp * r.cp * r.dp == r.gpus and r.global_batch % r.dp == 0, r.id
        assert r.config is None or (pv.CONFIGS / r.config).is_file(), r.id
        peak = get_cluster(r.cluster).device.peak_flops(
            "float8" if r.precision == "fp8" else "bfloat16")
        assert 0.05 < r.tflops_per_gpu * 1e12 / peak < 0.7, r.id
        # a published MFU, whatever the metric (MoE runs publish 7-16 %)
    assert {r.gpu for r in runs if r.fitted} == {"A100"}
    assert len({r.gpu for r in runs if not r.fitted}) >= 3


def test_a_recipes_attention_backend_and_gradient_dtype_are_read() -> None:
    """NeMo's GPT-3 175B recipe sets NVTE_FUSED_ATTN=0 (flash attention); the rest run
    Transformer Engine's default (blank). Its Llama recipes set grad_sync_dtype: bf16."""
    runs = pv.read_runs()
    assert {r.id for r in runs if r.attention == "flash2"} == {
        r.id for r in runs if r.id.startswith("nemo-24.11-h100-175b-")}
    assert {r.attention for r in runs} == {None, "flash2"}
    gpt3 = next(r for r in runs if r.attention)
    assert pv.cluster_for(gpt3).device.attention_rates == \
        with_attention(get_cluster(gpt3.cluster).device, "flash2").attention_rates
    plain = next(r for r in runs if r.id == "megatron-core-h100-1.7b")
    assert pv.cluster_for(plain) == get_cluster(plain.cluster)
    # NeMo's Llama 3.1 and GPT-3 175B recipes reduce bf16 gradients (grad_sync_dtype:
    # bf16), Megatron-Bridge's GPT-OSS ones too (grad_reduce_in_fp32 False); the rest keep
    # fp32 main gradients
    assert {r.id for r in runs if r.grads == "bf16"} == {
        r.id for r in runs if r.id.startswith(("nemo-24.09-h100-llama3.1-",
                                               "nemo-24.11-h100-175b-", "megatron-bridge-"))}
    assert {r.grads for r in runs} == {"fp32", "bf16"}
    assert pv.setting_for(runs[0]).megatron_grads == runs[0].grads
    llama = next(r for r in runs if r.grads == "bf16")
    assert pv.setting_for(llama).megatron_grads == "bf16"


def test_fp8_rows_are_the_bf16_tables_runs_with_fp8_linears() -> None:
    """dgxc-benchmarking's Llama 3.1 READMEs publish each configuration in BF16 and FP8: an
    FP8 row is its BF16 row (same keys, same model in bf16) priced with FP8 linears, and
    its step time gives the MFU the README states of the 1979 TFLOP/s FP8 peak."""
    runs = {r.id: r for r in pv.read_runs()}
    fp8 = [r for r in runs.values() if r.precision == "fp8" and r.id.startswith("nemo-")]
    assert len(fp8) == 14
    for r in fp8:
        twin = runs[r.id.replace("-fp8-", "-")]
        assert dataclasses.replace(r, id=twin.id, precision="bf16", published=twin.published,
                                   source=twin.source, fp8_params=False) == twin, r.id
        assert r.published < twin.published, r.id  # FP8 steps are faster
        setting = pv.setting_for(r)
        assert setting.fp8 and setting.precision == "bf16" and not pv.setting_for(twin).fp8
        # dgxc-benchmarking's configure.sh sets +model.fp8_params=$FP8_ENABLED
        assert r.fp8_params and setting.fp8_params and not twin.fp8_params
        assert pv.prepared_for(r) is pv.prepared_for(twin)  # one model, its values in bf16
    # (the 405B README's MFU counts 16 query groups in its Notes; the model has 8)
    for row, mfu in (("nemo-24.09-h100-llama3.1-8b-fp8-8", 0.3963),
                     ("nemo-24.09-h100-llama3.1-70b-fp8-64", 0.3617)):
        assert abs(runs[row].tflops_per_gpu / 1979 - mfu) < 0.003, row


def test_the_readme_tables_unpublished_keys_are_read_from_megatron_lm() -> None:
    """Megatron-LM's README table publishes no microbatch size: its rows take 1, as
    Megatron-LM's GPT-3 example sets it, not the planner's fastest pick. Its pipelined rows
    overlap pipeline communication, which core_r0.8.0 allows only interleaved: their
    virtual stages stay the planner's pick (blank), the others have none."""
    readme = [r for r in pv.read_runs() if r.id.startswith("megatron-core-h100-")]
    assert len(readme) == 9
    for r in readme:
        assert r.mbs == 1 and r.fix()["mbs"] == 1, r.id
        assert "train_gpt3_175b_distributed.sh" in r.source, r.id
        if r.pp == 1:
            assert r.vp == 1, r.id
        else:
            assert r.vp is None and "vp" not in r.fix() and "interleaved" in r.source, r.id


def test_the_flop_counts_are_the_sources() -> None:
    gpt3 = next(r for r in pv.read_runs() if r.id == "nemo-24.11-h100-175b-128")
    # the source's own model FLOPs per sample: 2.20E+15; MFU 49.93 % of 989 TFLOP/s
    assert abs(gpt3.step_flops() / gpt3.global_batch / 2.20e15 - 1) < 0.005
    assert abs(gpt3.tflops_per_gpu / 989 - 0.4993) < 0.002
    runs = {r.id: r for r in pv.read_runs()}
    # NeMo's Llama count, per sample, as dgxc-benchmarking's Notes give it
    for row, per_sample, mfu in (("nemo-24.09-h100-llama3.1-8b-8", 4.74e14, 0.5937),
                                 ("nemo-24.09-h100-llama3.1-70b-64", 3.94e15, 0.5410)):
        run = runs[row]
        assert abs(run.step_flops() / run.global_batch / per_sample - 1) < 0.005, row
        assert abs(run.tflops_per_gpu / 989 - mfu) < 0.003, row
    # the count Megatron-Bridge's TFLOP/s and tokens/s imply: one model, one count per token
    by_model: dict[str, list[float]] = {}
    for model, rows in (("gpt-oss-120b", 4), ("llama3-70b", 2)):
        implied = [r for r in runs.values() if r.flops == "implied" and model in r.id]
        by_model[model] = [r.step_flops() / (r.global_batch * r.seq) for r in implied]
        per_model = by_model[model]
        assert len(implied) == rows and max(per_model) / min(per_model) < 1.01, model
    per_token = by_model["gpt-oss-120b"]
    # ... and it is Megatron-Bridge's num_floating_point_operations for GPT-OSS 120B: its
    # experts counted without the gated third matrix (quick_gelu is not F.silu), attention
    # at full length with the causal half, logits at the vocabulary (flop_utils.py, v0.3.0)
    h, layers, heads, groups, seq, vocab, ffn, k = 2880, 36, 64, 8, 4096, 201088, 2880, 4
    bridge = (12 * layers * h * ffn * k
              + 12 * layers * h * h * (1 + groups / heads + seq / h / 2) * (heads * 64 / h)
              + 6 * h * vocab)
    assert all(abs(x / bridge - 1) < 0.005 for x in per_token)


def test_gpt_oss_rows_read_their_recipes() -> None:
    """Megatron-Bridge's GPT-OSS performance recipes (r0.2.0, v0.3.0): selective
    recomputation, the distributed optimizer, no virtual stages; H100 at microbatch 1,
    B200 at ep 64 and microbatch 4."""
    oss = {r.id: r for r in pv.read_runs()
           if r.id.startswith("megatron-bridge-") and "gpt-oss" in r.id}
    assert len(oss) == 4
    for r in oss.values():
        assert (r.recompute, r.zero, r.vp) == ("selective", "zero1", 1), r.id
        assert (r.mbs, r.ep) == ((1, 8) if r.gpu == "H100" else (4, 64)), r.id


@pytest.mark.parametrize("row", ["megatron-core-h100-7.1b", "sc21-table1-a100-1.7b",
                                 "nemo-24.09-h100-llama3.1-8b-8"])
def test_a_row_prices_at_its_published_configuration(row: str) -> None:
    run = next(r for r in pv.read_runs() if r.id == row)
    prep = pv.prepared_for(run)
    predicted, label = pv.price(run, prep)
    assert f"tp{run.tp} pp{run.pp} dp{run.dp}" in label
    assert run.cp == 1 or f"cp{run.cp}" in label
    assert 0.5 < predicted / run.tflops_per_gpu < 2.0
    if run.runtime == "megatron-core" and run.zero == "zero1" and run.cp == 1:
        # (at cp 2 smp-fx's runtime holds the whole logits: the 8B does not fit on 8)
        # its overlaps (tp, bucketed dp, distributed optimizer) hide what smp-fx's exposes
        mine = dataclasses.replace(run, runtime="smp-fx", mbs=1, recompute="none")
        theirs = dataclasses.replace(run, mbs=1, recompute="none")
        assert pv.price(mine, prep)[0] < pv.price(theirs, prep)[0]


def test_a_row_of_an_unknown_runtime_is_an_error(tmp_path: Path) -> None:
    lines = pv.DATA.read_text().splitlines()
    row = next(x for x in lines if x.startswith("korthikanti-a100-22b-full,"))
    data = tmp_path / "runs.csv"
    data.write_text("\n".join([*(x for x in lines if x.startswith(("#", "id,"))),
                               row.replace(",megatron-lm,", ",megatron,")]) + "\n")
    with pytest.raises(ValueError, match="runtime 'megatron' is none of"):
        pv.read_runs(data)


def test_a_refused_row_is_printed_and_counted(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    lines = pv.DATA.read_text().splitlines()
    row = next(x for x in lines if x.startswith("nemo-24.11-h100-175b-128,"))
    fields = row.split(",")  # GPT-3 175B on two nodes: its state alone outgrows 16 GPUs
    fields[0], fields[10:19] = "gpt3-on-16", ["16", "8", "1", "", "", "2", "8", "1", ""]
    data = tmp_path / "runs.csv"
    data.write_text("\n".join([*(x for x in lines if x.startswith("#") or x.startswith("id,")),
                               ",".join(fields)]) + "\n")
    assert pv.main(["--csv", str(data)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"gpt3-on-16 +refused: no plan fits in GPU memory", out), out
    assert "H100: 0 runs priced, 1 refused; none priced" in out


def test_korthikanti_rows_read_tables_3_and_5() -> None:
    """Korthikanti et al. (arXiv 2205.05198): Table 3's four configurations at Table 5's
    iteration times, with sequence parallelism and selective recomputation and with full
    recomputation alone, and the 530B at 8-way data parallelism (section 6.3); their step
    times under Megatron's model FLOP count give the MFU the paper states (of the A100's
    312 TFLOP/s)."""
    rows = {r.id: r for r in pv.read_runs() if r.id.startswith("korthikanti-")}
    assert len(rows) == 9
    for r in rows.values():
        assert (r.seq, r.vocab, r.tp) == (2048, 51200, 8), r.id
        assert r.mbs == (4 if r.layers == 48 else 1), r.id  # the 22B: one microbatch of 4
        assert r.dp == r.gpus // (r.tp * r.pp) == (8 if r.id.endswith("-dp8") else 1), r.id
        assert r.global_batch == r.dp * {48: 4, 96: 64, 105: 280, 128: 512}[r.layers], r.id
        assert (r.recompute, r.sp) in (("selective", True), ("full", False)), r.id
        assert r.vp == (3 if r.layers in (96, 105) else 1), r.id
        assert r.runtime == "megatron-lm", r.id  # its sequence-parallel activations
    for size, mfu in (("22b", 0.415), ("175b", 0.514), ("530b", 0.560), ("1t", 0.563),
                      ("530b", 0.542)):
        row = rows[f"korthikanti-a100-{size}-selective-sp" + ("-dp8" if mfu == 0.542 else "")]
        assert abs(row.tflops_per_gpu / 312 - mfu) < 0.003, (row.id, row.tflops_per_gpu / 312)


def test_megatron_bridge_llama_rows_read_their_recipes() -> None:
    """Megatron-Bridge's Llama 3 70B FP8 (current scaling) H100 recipe (v0.2.0, v0.3.0):
    tensor 4, pipeline 8, virtual 5, sequence parallelism, no recomputation, the
    distributed optimizer with bf16 gradients, the weights kept in FP8."""
    rows = [r for r in pv.read_runs() if r.id.startswith("megatron-bridge-")
            and "llama3-70b" in r.id]
    assert sorted(r.global_batch for r in rows) == [128, 256]
    for r in rows:
        assert (r.tp, r.pp, r.vp, r.cp, r.dp, r.mbs) == (4, 8, 5, 1, 2, 1), r.id
        assert (r.recompute, r.sp, r.zero, r.grads) == ("none", True, "zero1", "bf16"), r.id
        assert r.precision == "fp8" and r.fp8_params and pv.setting_for(r).fp8, r.id
        # Megatron-Bridge's count per token: 6 x 70.6B parameters and attention, ~4.49e11
        assert abs(r.step_flops() / (r.global_batch * r.seq) / 4.49e11 - 1) < 0.01, r.id


def test_megatron_bridge_405b_rows_count_the_ends_as_layers() -> None:
    """Megatron-Bridge's Llama 3.1 405B recipes (v0.2.0, v0.3.0; H100 and B200) split its
    126 layers with the embedding and the loss as layers
    (account_for_embedding_in_pipeline_split and ..._loss_...): 128 over pp 8 x v 8,
    which the plain even split refuses."""
    rows = [r for r in pv.read_runs() if r.split_ends]
    assert sorted(r.id for r in rows) == ["megatron-bridge-25.11-b200-llama3.1-405b-fp8",
                                          "megatron-bridge-25.11-h100-llama3.1-405b-fp8",
                                          "megatron-bridge-26.02-h100-llama3.1-405b-fp8"]
    for r in rows:
        tp, dp = (8, 8) if r.gpu == "H100" else (4, 2)
        assert (r.layers, r.tp, r.pp, r.vp, r.cp, r.dp) == (126, tp, 8, 8, 2, dp), r.id
        assert pv.setting_for(r).split_ends and r.fp8_params, r.id
    plain = dataclasses.replace(rows[0], split_ends=False)
    with pytest.raises(SMPError, match="do not divide them"):
        pv.price(plain)
