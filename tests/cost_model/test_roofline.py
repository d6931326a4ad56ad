from __future__ import annotations

import dataclasses
import functools

import pytest

from cost_model.device import DeviceSpec
from cost_model.errors import SMPConfigError, SMPInternalError
from cost_model.roofline import (
    comm_time,
    kind_of,
    link_model,
    link_time,
    node_times,
    roofline_time,
)

SPEC = DeviceSpec("test", peak_flops_fp32=1e12, peak_flops_bf16=4e12, mem_bandwidth=1e11,
                  memory_bytes=10**10, link_bandwidth=1e10, link_latency_s=1e-5)


def test_compute_and_memory_bound() -> None:
    assert roofline_time(1e12, 1e9, SPEC) == pytest.approx(1.0)  # compute bound
    assert roofline_time(1e9, 1e11, SPEC) == pytest.approx(1.0)  # memory bound
    assert roofline_time(4e12, 0, SPEC, "bfloat16") == pytest.approx(1.0)
    with pytest.raises(SMPInternalError, match="must be >= 0"):
        roofline_time(-1, 0, SPEC)


def test_comm_time() -> None:
    assert comm_time(0, SPEC) == 0.0
    assert comm_time(1e10, SPEC) == pytest.approx(1.0 + 1e-5)


def test_link_model_is_the_specs() -> None:
    comm, link = link_model(SPEC)
    assert comm(1e10) == comm_time(1e10, SPEC) and link(1e10) == pytest.approx(1.0)
    assert link_time(0, SPEC) == 0.0


def test_node_times_fixed_part_efficiency_and_rates() -> None:
    spec = dataclasses.replace(
        SPEC, matmul_efficiency=((16.0, 0.25), (256.0, 1.0)),
        op_overheads=(("default", 1e-6, 2e-6), ("linear", 3e-6, 4e-6), ("module", 5e-6, 0.0),
                      ("view", 0.5e-6, 0.5e-6)),
        op_rates=(("relu", 1e-9, 2e-9, 0.0),))
    # roofline at a quarter of the peak (smallest matmul dimension 16) plus the fixed part
    fwd, bwd = node_times("linear", spec, fwd_flops=1e6, bwd_flops=2e6, out_elems=0,
                          moved=0, gemm_dim=16, module=True)
    assert fwd == pytest.approx(3e-6 + 5e-6 + 1e6 / 0.25e12)
    assert bwd == pytest.approx(4e-6 + 2e6 / 0.25e12)
    assert node_times("addmm", spec, fwd_flops=1e6, bwd_flops=2e6, out_elems=0, moved=0,
                      gemm_dim=16, backward=False) == (pytest.approx(7e-6), 0.0)
    # a measured rate replaces the roofline: per output element here
    assert node_times("relu", spec, fwd_flops=1e3, bwd_flops=1e3, out_elems=1000,
                      moved=8000) == (pytest.approx(1e-6 + 1e-6), pytest.approx(2e-6 + 2e-6))
    # views move nothing; element-wise ops without a kind of their own are "default"
    assert node_times("transpose", spec, fwd_flops=0, bwd_flops=0, out_elems=10,
                      moved=80) == (0.5e-6, 0.5e-6)
    assert kind_of("add") == kind_of("sum") == "default" and kind_of("mm") == "matmul"
    # in place in a model: the fixed costs times overhead_scale, the work times compute_scale
    scaled = dataclasses.replace(spec, overhead_scale=3.0, compute_scale=1.5)
    assert node_times("relu", scaled, fwd_flops=1e3, bwd_flops=1e3, out_elems=1000,
                      moved=8000) == (pytest.approx(3e-6 + 1.5e-6), pytest.approx(6e-6 + 3e-6))
    assert node_times("transpose", scaled, fwd_flops=0, bwd_flops=0, out_elems=10,
                      moved=80) == (pytest.approx(1.5e-6), pytest.approx(1.5e-6))


def test_attention_runs_at_its_published_rate_by_key_length() -> None:
    rates = ((1024.0, 1e12, 0.5e12), (4096.0, 2e12, 1e12))
    spec = dataclasses.replace(SPEC, op_rates=(("sdpa", 1e-12, 1e-12, 64.0),),
                               attention_rates=rates)
    assert spec.attention_rate(1024) == (1e12, 0.5e12)
    assert spec.attention_rate(2048) == pytest.approx((1.5e12, 0.75e12))  # log-midway
    assert spec.attention_rate(65536) == (2e12, 1e12)  # clamped at the longest
    at = functools.partial(node_times, "sdpa", spec, fwd_flops=2e12, bwd_flops=4e12,
                           out_elems=0.0, moved=0.0, gemm_dim=64)
    assert at(seq=4096) == pytest.approx((1.0, 4.0))
    assert at(seq=1024) == pytest.approx((2.0, 8.0))
    assert at() == pytest.approx((2.0, 4.0))  # no length: the op_rates entry
    # a table out of order or with a zero rate is refused where the spec is made
    mixed = ((1024.0, 1e12, 1e12), (1024.0, 1e12, 1e12, 64.0))  # some rows with a width
    for bad in (rates[::-1], ((1024.0, 0.0, 1e12),), mixed):
        with pytest.raises(SMPConfigError, match="attention_rates"):
            dataclasses.replace(SPEC, attention_rates=bad)
    assert DeviceSpec.from_json(spec.to_json()) == spec
    widths = dataclasses.replace(spec, attention_rates=tuple(
        (*r, 64.0) for r in rates) + tuple((s, 2 * f, 2 * b, 128.0) for s, f, b in rates))
    assert at(seq=4096, head_dim=128) == pytest.approx((1.0, 4.0))  # rows of every width
    by_width = functools.partial(node_times, "sdpa", widths, fwd_flops=2e12, bwd_flops=4e12,
                                 out_elems=0.0, moved=0.0, seq=4096)
    assert by_width(head_dim=64) == pytest.approx((1.0, 4.0))
    assert by_width(head_dim=128) == by_width() == pytest.approx((0.5, 2.0))
    assert DeviceSpec.from_json(widths.to_json()) == widths
