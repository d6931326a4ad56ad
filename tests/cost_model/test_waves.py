"""Wave quantization (``cost_model.waves``): exact wave counts, relative to the table's shapes."""

from __future__ import annotations

import dataclasses

import pytest

from cost_model.calibrate import LOOPBACK
from cost_model.device import DeviceSpec
from cost_model.devices import get_device
from cost_model.errors import SMPConfigError
from cost_model.gpu_specs import A100_80GB, B200, H100_SXM, H200_SXM, SOURCED_GPUS
from cost_model.roofline import node_times
from cost_model.waves import (
    Gemm,
    gemm_factors,
    quantization,
    table_quantization,
    tiles,
    wave_efficiency,
    wave_gemm,
)

H100 = H100_SXM  # 132 SMs, 128 x 256 tiles, its table measured as linears against 8192


def test_wave_efficiency_counts_the_idle_share_of_the_last_wave() -> None:
    assert wave_efficiency(132, 132) == 1.0 and wave_efficiency(396, 132) == 1.0
    assert wave_efficiency(352, 132) == pytest.approx(352 / 396)  # 2.67 waves take 3
    assert wave_efficiency(448, 132) == pytest.approx(448 / 528)  # 3.39 waves take 4
    assert wave_efficiency(133, 132) == pytest.approx(133 / 264)
    assert wave_efficiency(1, 132) == pytest.approx(1 / 132)


def test_tiles_round_each_side_up() -> None:
    assert tiles(4096, 2688, (128, 256)) == 32 * 11 == 352  # the 32B's QKV at tp 8
    assert tiles(4096, 3584, (128, 256)) == 32 * 14 == 448  # its FC1
    assert tiles(129, 257, (128, 256), batch=3) == 3 * 2 * 2


def test_quantization_on_the_h100() -> None:
    assert quantization(4096, 2688, H100) == pytest.approx(352 / 396)
    assert quantization(512, 33 * 256, H100) == 1.0  # 4 x 33 tiles: one whole wave
    assert quantization(1024, 33 * 256, H100) == 1.0  # two
    # fewer tiles than SMs: outside the model (smaller tiles or a split contraction)
    assert quantization(128, 256, H100) == 1.0 and quantization(512, 8192, H100) == 1.0


def test_the_table_carries_the_quantization_of_its_own_shapes() -> None:
    big = wave_efficiency(64 * 32, 132)  # 8192 x 8192 in 128 x 256 tiles: 15.5 waves
    assert table_quantization(8192, H100) == pytest.approx(big)
    assert table_quantization(1e5, H100) == pytest.approx(big)
    # (512, 8192, 8192), (8192, 512, 8192), (8192, 8192, 512): 128, 2048 and 128 tiles
    at_512 = 3 / (1 + 1 / big + 1)
    assert table_quantization(512, H100) == pytest.approx(at_512)
    assert table_quantization(16, H100) == pytest.approx(at_512)
    # a cube table (the B200's): 2048^3 is 128 tiles on 148 SMs, 4096^3 512
    assert table_quantization(2048, B200) == 1.0
    assert table_quantization(4096, B200) == pytest.approx(wave_efficiency(512, 148))
    assert table_quantization(8192, A100_80GB) == 1.0  # fitted: no shapes of its own


def test_factors_of_the_32b_at_tp_8_relative_to_the_table() -> None:
    ref = table_quantization(2688, H100)
    fwd, bwd = gemm_factors(Gemm(4096, 7168, 2688), H100)  # QKV: 352 output tiles
    assert fwd == pytest.approx((352 / 396) / ref)
    dgrad, wgrad = wave_efficiency(32 * 28, 132), wave_efficiency(21 * 28, 132)
    assert bwd == pytest.approx(2 / (1 / dgrad + 1 / wgrad) / ref)
    fwd, _ = gemm_factors(Gemm(4096, 7168, 3584), H100)  # FC1: 448
    assert fwd == pytest.approx((448 / 528) / table_quantization(3584, H100))
    assert 0.86 < fwd < 0.88


def test_whole_waves_are_priced_at_the_table_less_its_own_quantization() -> None:
    g = Gemm(132 * 128, 256, 256)  # forward 132 tiles, input gradient 132, weight 2
    ref = table_quantization(256, H100)
    assert gemm_factors(g, H100) == (pytest.approx(1 / ref), pytest.approx(1 / ref))
    assert ref < 1.0


def test_a_gemm_of_one_tile() -> None:
    one = Gemm(128, 64, 256)
    assert tiles(one.m, one.n, H100.gemm_tile) == 1
    ref = table_quantization(64, H100)
    assert gemm_factors(one, H100) == (pytest.approx(1 / ref), pytest.approx(1 / ref))


@pytest.mark.parametrize("spec", [LOOPBACK, get_device("h100"), get_device("a100"),
                                  dataclasses.replace(H100, sm_count=0),
                                  dataclasses.replace(H100, gemm_tile=())])
def test_a_device_without_sm_count_or_tile_is_priced_as_before(spec: DeviceSpec) -> None:
    g = Gemm(4096, 7168, 2688)
    assert gemm_factors(g, spec) == (1.0, 1.0)
    flops = 2.0 * 4096 * 7168 * 2688
    plain = node_times("linear", spec, fwd_flops=flops, bwd_flops=2 * flops, out_elems=0,
                       moved=0, dtype="bfloat16", gemm_dim=2688)
    assert node_times("linear", spec, fwd_flops=flops, bwd_flops=2 * flops, out_elems=0,
                      moved=0, dtype="bfloat16", gemm=g) == plain
    assert spec.sm_count == 0 or not spec.gemm_tile


def test_node_times_divide_by_the_factors() -> None:
    g = Gemm(4096, 7168, 2688)
    flops = 2.0 * 4096 * 7168 * 2688
    kw = {"fwd_flops": flops, "bwd_flops": 2 * flops, "out_elems": 0, "moved": 1e6,
          "dtype": "bfloat16"}
    plain_f, plain_b = node_times("linear", H100, gemm_dim=2688, **kw)  # type: ignore[arg-type]
    fwd, bwd = node_times("linear", H100, gemm=g, **kw)  # type: ignore[arg-type]
    wf, wb = gemm_factors(g, H100)
    assert (fwd, bwd) == (pytest.approx(plain_f / wf), pytest.approx(plain_b / wb))
    assert fwd > plain_f


def test_wave_gemm_reads_the_batch_and_leaves_other_ops() -> None:
    assert wave_gemm("linear", (16, 512, 2048), (2, 8, 2048)) == Gemm(16, 512, 2048)
    assert wave_gemm("bmm", (128, 64, 128), (32, 128, 128)) == Gemm(128, 64, 128, 32)
    assert wave_gemm("sdpa", (128, 64, 128), (1, 128, 64)) is None
    assert wave_gemm("grouped_mm", (128, 64, 128), (1024, 128)) is None
    assert wave_gemm("linear", None, (2, 8)) is None


def test_shard_splits_outputs_or_contraction() -> None:
    g = Gemm(4096, 7168, 21504)
    assert g.shard(n_parts=8) == Gemm(4096, 7168, 2688)
    assert g.shard(k_parts=8) == Gemm(4096, 896, 21504)
    assert Gemm(10, 10, 10).shard(n_parts=4).n == 3


def test_the_sourced_gpus_name_their_sm_count_and_tile() -> None:
    expected = {"a100-40gb": 108, "a100-80gb": 108, "h100-sxm": 132, "h200-sxm": 132,
                "b200": 148}
    for key, spec in SOURCED_GPUS.items():
        assert spec.sm_count == expected[key] and len(spec.gemm_tile) == 2
        for name in ("sm_count", "gemm_tile", "matmul_shapes"):
            assert spec.source(name), (key, name)
    assert H200_SXM.gemm_tile == H100.gemm_tile
    for spec in (LOOPBACK, get_device("h100")):
        assert "not known" in spec.source("sm_count")


def test_spec_fields_round_trip_and_are_checked() -> None:
    assert DeviceSpec.from_json(H100.to_json()) == H100
    plain = get_device("a100").to_json()
    assert "sm_count" not in plain and "gemm_tile" not in plain  # read as before
    with pytest.raises(SMPConfigError, match="gemm_tile"):
        dataclasses.replace(H100, gemm_tile=(128,))
    with pytest.raises(SMPConfigError, match="sm_count"):
        dataclasses.replace(H100, sm_count=-1)
    with pytest.raises(SMPConfigError, match="matmul_shapes"):
        dataclasses.replace(H100, matmul_shapes="square")
