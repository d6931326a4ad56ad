"""``cost_model.calibrate``: the shape of a quick calibration, the built-in "cpu" spec."""

from __future__ import annotations

import json

from cost_model.calibrate import quick_cpu_spec
from cost_model.device import DeviceSpec
from cost_model.devices import get_device
from cost_model.microbench import QUICK


def test_quick_cpu_spec_has_every_measured_field() -> None:
    spec = quick_cpu_spec()
    assert get_device("cpu") is spec  # measured once per process
    assert spec.name == "cpu" and spec.peak_flops_fp32 > 1e8 and spec.mem_bandwidth > 1e8
    dims = [d for d, _ in spec.matmul_efficiency]
    assert dims == sorted(QUICK.matmul_dims) and max(f for _, f in spec.matmul_efficiency) == 1
    assert len(spec.elementwise_efficiency) == len(QUICK.elementwise_bytes)
    kinds = {k: (f, b) for k, f, b in spec.op_overheads}
    assert set(kinds) == set(QUICK.op_kinds) and kinds["module"][1] == 0.0
    assert all(f >= 0 and b >= 0 for f, b in kinds.values())
    rates = {k: (f, b) for k, f, b, _ in spec.op_rates}
    assert set(rates) == set(QUICK.op_kinds) - {"view", "module"}  # those move no data
    assert all(f >= 0 and b >= 0 for f, b in rates.values())
    assert spec.optimizer_tensor_s > 0 and spec.optimizer_byte_s > 0
    assert "quick" in spec.source("op_overheads") and "estimate" in spec.source(
        "optimizer_tensor_s")
    assert DeviceSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
