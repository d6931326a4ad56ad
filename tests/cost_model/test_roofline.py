from __future__ import annotations

import pytest

from cost_model.device import DeviceSpec
from cost_model.errors import SMPInternalError
from cost_model.roofline import comm_time, roofline_time

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
