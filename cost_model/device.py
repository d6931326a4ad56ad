"""Device specs as data: a plan can be made for a cluster one does not have.

Numbers for "h100", "a100" and "v100" are public datasheet figures (SXM parts, dense, no
sparsity); ``link_bandwidth`` is the NVLink bandwidth per direction. "cpu" is measured on
this machine, once per process (``calibrate_cpu``), so it is *not* deterministic: analytic
tests and golden plans must use a fixed spec.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from cost_model.errors import SMPConfigError
from cost_model.serial import from_versioned_json, versioned_json

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of one accelerator and its link to the next stage."""

    name: str
    peak_flops_fp32: float
    peak_flops_bf16: float
    mem_bandwidth: float  # bytes/s
    memory_bytes: int
    link_bandwidth: float  # bytes/s, one direction
    link_latency_s: float

    def peak_flops(self, dtype: str = "float32") -> float:
        """Peak FLOP/s for a value dtype name (half types use the bf16 tensor-core peak)."""
        return self.peak_flops_bf16 if dtype in ("bfloat16", "float16") else self.peak_flops_fp32

    def to_json(self) -> dict[str, Any]:
        return versioned_json(self, SCHEMA_VERSION)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceSpec:
        return from_versioned_json(cls, data, SCHEMA_VERSION)


GB = 1e9
GiB = 1024**3

H100 = DeviceSpec("h100", 67e12, 989.4e12, 3.35e12, 80 * GiB, 450 * GB, 5e-6)
A100 = DeviceSpec("a100", 19.5e12, 312e12, 2.039e12, 80 * GiB, 300 * GB, 5e-6)
V100 = DeviceSpec("v100", 15.7e12, 125e12, 0.9e12, 32 * GiB, 150 * GB, 5e-6)

_FIXED: dict[str, DeviceSpec] = {s.name: s for s in (H100, A100, V100)}


def device_names() -> tuple[str, ...]:
    return (*_FIXED, "cpu")


def get_device(name: str) -> DeviceSpec:
    """A spec by name: "h100", "a100", "v100" (datasheet) or "cpu" (calibrated here)."""
    key = name.lower()
    if key == "cpu":
        return calibrate_cpu()
    if key not in _FIXED:
        raise SMPConfigError.build("unknown device spec name", name, "cost_model.get_device",
                                   f"use one of {list(device_names())} or build a DeviceSpec")
    return _FIXED[key]


@functools.lru_cache(maxsize=1)
def calibrate_cpu(matmul_n: int = 512, copy_mib: int = 64, repeats: int = 3) -> DeviceSpec:
    """Measure this CPU's fp32 matmul FLOP/s and copy bandwidth (best of ``repeats``).

    The link between CPU "stages" is gloo over loopback; it is not measured here and is
    set to a conservative 5 GB/s with 50 us latency.
    """
    a = torch.randn(matmul_n, matmul_n)
    b = torch.randn(matmul_n, matmul_n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    flops = 2.0 * matmul_n**3 / max(best, 1e-9)
    src = torch.empty(copy_mib * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    bandwidth = 2.0 * src.numel() * 4 / max(best, 1e-9)  # read + write
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 16 * GiB
    return DeviceSpec("cpu", flops, flops, bandwidth, int(memory), 5 * GB, 50e-6)
