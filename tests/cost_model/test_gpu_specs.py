"""The built-in clusters' GPUs: every number says where it comes from, fits are declared."""

from __future__ import annotations

from dataclasses import fields

import pytest

from cost_model.cluster import CLUSTERS, GPU_TYPE
from cost_model.device import DeviceSpec
from cost_model.gpu_specs import FITTED_ON, SOURCED_GPUS

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
