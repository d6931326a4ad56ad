"""The built-in clusters' GPUs: every number says where it comes from, fits are declared."""

from __future__ import annotations

from dataclasses import fields

import pytest

from cost_model.cluster import CLUSTERS, GPU_TYPE
from cost_model.device import DeviceSpec
from cost_model.gpu_specs import (
    FITTED_ON,
    HOPPER_FLASH2_ATTENTION,
    HOPPER_TE_ATTENTION,
    SOURCED_GPUS,
    with_attention,
    with_te_attention,
)

# numbers a GPU's spec holds that a plan at scale reads; the ideal defaults (scales 1.0,
# no runtime overheads) are not figures and need no source
FIGURES = ("peak_flops_fp32", "peak_flops_bf16", "mem_bandwidth", "memory_bytes",
           "link_bandwidth", "matmul_efficiency", "elementwise_efficiency", "op_overheads")


@pytest.mark.parametrize("name", sorted(SOURCED_GPUS))
def test_every_figure_of_a_sourced_gpu_names_its_source(name: str) -> None:
    spec = SOURCED_GPUS[name]
    missing = [f for f in FIGURES if not spec.source(f)]
    if spec.op_rates:
        missing += [] if spec.source("op_rates") else ["op_rates"]
    assert not missing, f"{name}: no source for {missing}"
    # every non-default number is among the sourced ones
    default = {f.name: f.default for f in fields(DeviceSpec)}
    sourced = {k for k, _ in spec.sources}
    for f in fields(DeviceSpec):
        value = getattr(spec, f.name)
        if f.name in ("name", "sources") or value == default.get(f.name):
            continue
        assert f.name in sourced, f"{name}.{f.name} = {value!r} has no source"


def test_the_fit_is_declared_and_only_the_a100s_carry_it() -> None:
    for name, spec in SOURCED_GPUS.items():
        text = spec.source("matmul_efficiency")
        assert ("fitted" in text) == (name in FITTED_ON), (name, text)
    for name, (field, how) in FITTED_ON.items():
        assert "Table 1" in how and SOURCED_GPUS[name].source(field).startswith(how)


def test_every_cluster_runs_a_sourced_gpu_and_has_a_type() -> None:
    gpus = {id(s) for s in SOURCED_GPUS.values()}
    for name, cluster in CLUSTERS.items():
        assert name in GPU_TYPE
        if GPU_TYPE[name] != "V100":
            assert id(cluster.device) in gpus, name


def test_megatron_core_runs_take_transformer_engine_attention_where_published() -> None:
    """Hopper: cuDNN's causal attention by sequence length (FlashAttention-3's paper),
    sourced; 8K tokens run faster than 1K; GPUs without a published table are unchanged."""
    for name in ("h100-sxm", "h200-sxm"):
        spec = with_te_attention(SOURCED_GPUS[name])
        assert spec.attention_rates == HOPPER_TE_ATTENTION
        assert "2407.08608" in spec.source("attention_rates")
        fwd_1k, bwd_1k = spec.attention_rate(1024) or (0.0, 0.0)
        fwd_8k, bwd_8k = spec.attention_rate(8192) or (0.0, 0.0)
        assert fwd_8k > fwd_1k > 0 and bwd_8k > bwd_1k > 0
        assert not SOURCED_GPUS[name].attention_rates  # smp-fx's own runs: measured sdpa
    for name in ("a100-80gb", "b200"):
        assert with_te_attention(SOURCED_GPUS[name]) is SOURCED_GPUS[name]


def test_attention_runs_at_its_head_dimensions_published_rates() -> None:
    """Narrow heads run slower (head dimension 64: cuDNN's causal forward 363 TFLOP/s at 4K
    against 518 at 128, counted on half the square); a width between the published ones
    is interpolated, one outside them clamped, an unknown one priced at the widest."""
    spec = with_te_attention(SOURCED_GPUS["h100-sxm"])
    narrow, wide = spec.attention_rate(4096, 64), spec.attention_rate(4096, 128)
    assert narrow == pytest.approx((2 * 363e12, 1.6 * 417e12))
    assert wide == pytest.approx((2 * 518e12, 1.6 * 499e12))
    between = spec.attention_rate(4096, 96) or (0.0, 0.0)
    assert narrow[0] < between[0] < wide[0] and narrow[1] < between[1] < wide[1]
    assert spec.attention_rate(4096, 32) == narrow
    assert spec.attention_rate(4096, 256) == spec.attention_rate(4096) == wide


def test_a_recipe_that_turns_cudnn_off_takes_flash_attention_2s_published_rates() -> None:
    """FlashAttention-3's paper's FlashAttention-2 bars (causal forward, backward) on
    full-square FLOPs: forward x 2, backward x 2 x 2 / 2.5; slower than cuDNN at every
    length; no table for other GPUs or backends: an error, not a silent default."""
    fwd_bars = {64: (180, 229, 262, 284, 295, 299), 128: (191, 260, 298, 319, 333, 335)}
    bwd_bars = {64: (198, 238, 264, 279, 287, 291), 128: (214, 260, 291, 310, 318, 322)}
    assert len(HOPPER_FLASH2_ATTENTION) == 12
    for j, dim in enumerate((64, 128)):
        rows = HOPPER_FLASH2_ATTENTION[6 * j:6 * j + 6]
        for i, ((seq, fwd, bwd, d), f, b) in enumerate(zip(rows, fwd_bars[dim], bwd_bars[dim],
                                                           strict=True)):
            assert (seq, d) == (512 * 2**i, dim)  # the figures' lengths, 512 to 16K
            assert fwd == pytest.approx(2 * f * 1e12) and bwd == pytest.approx(1.6 * b * 1e12)
    spec = with_attention(SOURCED_GPUS["h100-sxm"], "flash2")
    assert spec.attention_rates == HOPPER_FLASH2_ATTENTION
    assert "FlashAttention-2" in spec.source("attention_rates")
    assert with_te_attention(spec) is spec  # Megatron-Core's runs keep the recipe's pick
    assert with_attention(SOURCED_GPUS["h200-sxm"], "cudnn").attention_rates == \
        HOPPER_TE_ATTENTION
    for (_, f2, b2, _), (_, fc, bc, _) in zip(HOPPER_FLASH2_ATTENTION, HOPPER_TE_ATTENTION,
                                              strict=True):
        assert f2 < fc and b2 < bc
    for name, backend in (("a100-80gb", "flash2"), ("h100-sxm", "flash3")):
        with pytest.raises(ValueError, match="no published rates"):
            with_attention(SOURCED_GPUS[name], backend)
