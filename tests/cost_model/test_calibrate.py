"""``cost_model.calibrate``: the shape of what it measures (quick mode), and the link."""

from __future__ import annotations

import json

import torch

from cost_model.calibrate import QUICK, measure_link, quick_cpu_spec, time_per_call
from cost_model.device import DeviceSpec, get_device
from tests.helpers.dist import run_ranks


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


def test_time_per_call_is_the_best_repeat() -> None:
    calls: list[int] = []
    # a probe call of 1 s, so one call per repeat; repeats of 3, 1 and 2 s
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 21.0, 30.0, 32.0])
    t = time_per_call(lambda: calls.append(1), repeats=3, target_s=0.5,
                      now=lambda: next(ticks))
    assert t == 1.0 and len(calls) == 2 + 3  # a warm-up and a probe, then the repeats


def _link() -> tuple[float, float, float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return measure_link(QUICK, torch.device("cpu"))


def test_measure_link_between_two_ranks() -> None:
    results = run_ranks(_link, 2, timeout=120)
    for latency, bandwidth, per_message in results:
        assert 0 < latency < 1.0 and bandwidth > 1e5 and 0 < per_message < 1.0
