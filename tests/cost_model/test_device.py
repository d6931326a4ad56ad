from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost_model.device import SCHEMA_VERSION, DeviceSpec
from cost_model.devices import A100, H100, V100, get_device, load_device, spec_for_device_name
from cost_model.errors import SMPConfigError


def test_named_specs_and_json_roundtrip() -> None:
    assert get_device("H100") is H100 and get_device("a100") is A100 and get_device("v100") is V100
    assert H100.peak_flops("bfloat16") > H100.peak_flops("float32") > A100.peak_flops("float32")
    for spec in (H100, A100, V100):
        assert DeviceSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
        assert "datasheet" in spec.source("peak_flops_fp32")
    with pytest.raises(SMPConfigError, match="tpu"):
        get_device("tpu")


def test_other_schema_versions_and_fields_are_rejected() -> None:
    data = H100.to_json()
    with pytest.raises(SMPConfigError, match="DeviceSpec schema_version.*smp-fx calibrate"):
        DeviceSpec.from_json({**data, "schema_version": SCHEMA_VERSION - 1})
    with pytest.raises(SMPConfigError, match="unknown.*flux"):
        DeviceSpec.from_json({**data, "flux": 1.0})
    del data["peak_flops_fp32"]
    with pytest.raises(SMPConfigError, match="missing.*peak_flops_fp32"):
        DeviceSpec.from_json(data)
    with pytest.raises(SMPConfigError, match="mem_bandwidth must be > 0"):
        dataclasses.replace(H100, mem_bandwidth=0.0)
    with pytest.raises(SMPConfigError, match="sorted by size"):
        dataclasses.replace(H100, matmul_efficiency=((64.0, 0.5), (16.0, 0.2)))


def test_tables_interpolate_in_log_size_and_clamp() -> None:
    spec = dataclasses.replace(
        A100, matmul_efficiency=((16.0, 0.2), (256.0, 0.8)),
        elementwise_efficiency=((1e3, 2.0), (1e6, 1.0)),
        op_overheads=(("default", 1e-6, 2e-6), ("linear", 3e-6, 4e-6)))
    assert spec.matmul_fraction(4) == 0.2 and spec.matmul_fraction(1e5) == 0.8
    assert spec.matmul_fraction(64) == pytest.approx(0.5)  # halfway in log(16)..log(256)
    assert spec.bandwidth(1e9) == A100.mem_bandwidth
    assert spec.bandwidth(10**4.5) == pytest.approx(1.5 * A100.mem_bandwidth)
    assert spec.op_overhead("linear") == (3e-6, 4e-6)
    assert spec.op_overhead("gelu") == (1e-6, 2e-6)
    assert DeviceSpec("x", 1.0, 1.0, 1.0, 1, 1.0, 0.0).op_overhead("gelu") == (0.0, 0.0)


def test_load_device_from_a_name_or_a_file(tmp_path: Path) -> None:
    assert load_device("h100") is H100
    path = tmp_path / "spec.json"
    mine = dataclasses.replace(V100, name="my-gpu", message_overhead_s=3e-6)
    path.write_text(json.dumps(mine.to_json()), encoding="utf-8")
    assert load_device(str(path)) == mine
    with pytest.raises(SMPConfigError, match="built-in name or a JSON file"):
        load_device(str(tmp_path / "missing.json"))
    path.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(SMPConfigError, match="JSON object"):
        load_device(str(path))


def test_spec_for_device_name() -> None:
    assert spec_for_device_name("NVIDIA H100 80GB HBM3") == "h100"
    assert spec_for_device_name("NVIDIA A100-SXM4-40GB") == "a100"
    assert spec_for_device_name("Tesla V100-SXM2-32GB") == "v100"
    assert spec_for_device_name("NVIDIA GeForce RTX 4090") is None


def test_an_h200_or_b200_is_planned_for_with_its_sourced_spec_not_the_default() -> None:
    from cost_model.gpu_specs import B200, H200_SXM

    assert spec_for_device_name("NVIDIA H200") == "h200"  # torch.cuda's name on an H200 SXM
    assert spec_for_device_name("NVIDIA B200") == "b200"
    assert load_device("h200") is H200_SXM and get_device("B200") is B200
    assert H200_SXM.memory_bytes > A100.memory_bytes  # the default would refuse what fits


def test_a_pipeline_folds_the_pipelined_scale_in_once() -> None:
    spec = dataclasses.replace(A100, compute_scale=1.5, overhead_scale=2.0, pipelined_scale=1.2)
    assert spec.for_stages(1) is spec
    two = spec.for_stages(2)
    assert (two.compute_scale, two.overhead_scale, two.pipelined_scale) == (
        pytest.approx(1.8), pytest.approx(2.4), 1.0)
    assert two.for_stages(2) == two  # a plan's recorded spec is not scaled again
    assert DeviceSpec.from_json(spec.to_json()) == spec
    with pytest.raises(SMPConfigError, match="pipelined_scale must be > 0"):
        dataclasses.replace(A100, pipelined_scale=0.0)
