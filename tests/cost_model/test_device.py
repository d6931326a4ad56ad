from __future__ import annotations

import pytest

from cost_model.device import A100, H100, V100, DeviceSpec, calibrate_cpu, get_device
from cost_model.errors import SMPConfigError


def test_named_specs_and_json_roundtrip() -> None:
    assert get_device("H100") is H100 and get_device("a100") is A100 and get_device("v100") is V100
    assert H100.peak_flops("bfloat16") > H100.peak_flops("float32") > A100.peak_flops("float32")
    for spec in (H100, A100, V100):
        assert DeviceSpec.from_json(spec.to_json()) == spec
    with pytest.raises(SMPConfigError, match="tpu"):
        get_device("tpu")
    with pytest.raises(SMPConfigError):
        DeviceSpec.from_json({**H100.to_json(), "schema_version": 99})


def test_cpu_calibration_is_measured_once() -> None:
    spec = calibrate_cpu()
    assert spec.name == "cpu" and spec.peak_flops_fp32 > 1e8 and spec.mem_bandwidth > 1e8
    assert get_device("cpu") is spec  # cached in-process


def test_spec_json_round_trip_and_schema_check() -> None:
    import pytest

    from cost_model.device import DeviceSpec, get_device
    from cost_model.errors import SMPConfigError

    spec = get_device("h100")
    assert DeviceSpec.from_json(spec.to_json()) == spec
    with pytest.raises(SMPConfigError, match="DeviceSpec schema_version"):
        DeviceSpec.from_json({**spec.to_json(), "schema_version": 99})
