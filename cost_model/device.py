"""Device specs as data: a plan can be made for a cluster one does not have.

A ``DeviceSpec`` is everything the cost model knows about one accelerator, its link to the
next pipeline stage and the smp-fx runtime on its host: peak rates, how close small
matmuls and element-wise ops come to them, the fixed cost of an op, of a message, of a
microbatch and of a step, and what an optimizer step costs. It is the one source of link
costs: the partitioner, the plan and the simulator all read them from here.

Built-in specs: "h100", "a100", "v100" carry datasheet figures (SXM parts, dense, no
sparsity) and rounded estimates for the rest; each says where its numbers come from
(``sources``). "cpu" is measured on this machine, once per process, by the quick mode of
``cost_model.calibrate``: it is *not* deterministic, so analytic tests and golden plans
use a fixed spec. ``smp-fx calibrate -o FILE.json`` measures any machine fully and
``load_device`` reads the file back.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from cost_model.errors import SMPConfigError
from cost_model.serial import versioned_json

SCHEMA_VERSION = 2
DEFAULT_DEVICE = "a100"
"""The spec a plan is made for when the caller names none."""

Table = tuple[tuple[float, float], ...]
OpOverheads = tuple[tuple[str, float, float], ...]
OpRates = tuple[tuple[str, float, float, float], ...]


def _interp_log(table: Table, x: float) -> float:
    """Piecewise-linear in ``log(x)`` through ``table`` ((x, y) sorted by x), clamped."""
    if not table:
        return 1.0
    xs = [p[0] for p in table]
    if x <= xs[0]:
        return table[0][1]
    if x >= xs[-1]:
        return table[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates of one accelerator, its link to the next stage, and fixed costs.

    Fields beyond the peaks (all default to the ideal: no overhead, full efficiency):

    - ``matmul_efficiency``: (smallest matmul dimension, fraction of peak FLOP/s) pairs;
      a matmul whose smallest of (m, k, n) is ``d`` runs at the interpolated fraction.
    - ``elementwise_efficiency``: (bytes moved, fraction of ``mem_bandwidth``) pairs;
      small tensors live in cache and may beat the memory bandwidth (fraction > 1).
    - ``op_overheads``: (canonical op, forward s, backward s): the fixed time of one op
      (dispatch, kernel launch, autograd bookkeeping) on top of its roofline time; the
      entry ``"default"`` serves ops not listed, ``"module"`` is the extra forward cost
      of calling an ``nn.Module`` (fx leaf modules), ``"view"`` serves view ops.
    - ``op_rates``: (op kind, forward s, backward s per unit, reference size): what an op
      of this kind costs per FLOP (matmul kinds) or per output element (the others) at a
      reference size (smallest matmul dimension, or bytes moved), measured on the machine;
      the efficiency tables scale it to other sizes. A kind listed here is priced by its
      rate instead of the roofline (CPU kernels for batch norm or transcendental
      functions run far below the roofline's peak and bandwidth).
    - ``message_overhead_s``: time a rank's compute loses per point-to-point message it
      sends or receives (posting and completing it); ``link_latency_s`` delays arrival.
    - ``microbatch_overhead_s``: the runtime's work per forward or backward action of a
      stage (turn-taking, the step function's thread), beyond the model's ops.
    - ``step_overhead_s``: the runtime's fixed work per training step.
    - ``optimizer_tensor_s`` / ``optimizer_byte_s``: an optimizer step costs
      ``tensors * optimizer_tensor_s + parameter bytes * optimizer_byte_s`` (Adam).
    - ``compute_scale`` / ``overhead_scale``: how much slower a model's ops run inside a
      real forward and backward than the microbenchmarks above time them alone (colder
      caches, the allocator, autograd's graph): ``compute_scale`` multiplies each node's
      work, ``overhead_scale`` its fixed cost (``op_overheads``). Calibration fits both on
      a reference model at several sizes; 1.0 for datasheet specs.
    - ``pipelined_scale``: how much slower the ops run again when the ranks of a pipeline
      share this host's cores (their threads and caches), fitted by ``smp-fx calibrate
      --nproc N`` on the reference model at pipeline degree N; 1.0 where each rank has its
      own device. ``for_stages`` folds it into the two scales above.
    - ``sources``: (field, where its number comes from) pairs.
    """

    name: str
    peak_flops_fp32: float
    peak_flops_bf16: float
    mem_bandwidth: float  # bytes/s
    memory_bytes: int
    link_bandwidth: float  # bytes/s, one direction
    link_latency_s: float
    matmul_efficiency: Table = ()
    elementwise_efficiency: Table = ()
    op_overheads: OpOverheads = ()
    op_rates: OpRates = ()
    message_overhead_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    optimizer_tensor_s: float = 0.0
    optimizer_byte_s: float = 0.0
    compute_scale: float = 1.0
    overhead_scale: float = 1.0
    pipelined_scale: float = 1.0
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> SMPConfigError:
            return SMPConfigError.build(rule, getattr(self, name), f"DeviceSpec.{name}",
                                        "re-run smp-fx calibrate or fix the spec file")

        for name in ("peak_flops_fp32", "peak_flops_bf16", "mem_bandwidth", "link_bandwidth",
                     "compute_scale", "overhead_scale", "pipelined_scale"):
            if not float(getattr(self, name)) > 0:
                raise bad(name, f"{name} must be > 0")
        for name in ("link_latency_s", "message_overhead_s", "microbatch_overhead_s",
                     "step_overhead_s", "optimizer_tensor_s", "optimizer_byte_s"):
            if not float(getattr(self, name)) >= 0:
                raise bad(name, f"{name} must be >= 0")
        for name in ("matmul_efficiency", "elementwise_efficiency"):
            table = getattr(self, name)
            if any(x <= 0 or y <= 0 for x, y in table) or list(table) != sorted(table):
                raise bad(name, f"{name} needs (size > 0, fraction > 0) pairs sorted by size")
        if any(f < 0 or b < 0 for _, f, b in self.op_overheads):
            raise bad("op_overheads", "op_overheads needs times >= 0")
        if any(f < 0 or b < 0 or r < 0 for _, f, b, r in self.op_rates):
            raise bad("op_rates", "op_rates needs rates and reference sizes >= 0")
        # tables hold floats, as JSON gives them back: a spec equals its round trip
        for name in ("matmul_efficiency", "elementwise_efficiency"):
            object.__setattr__(self, name, tuple((float(x), float(y))
                                                 for x, y in getattr(self, name)))
        object.__setattr__(self, "op_overheads", tuple(
            (str(o), float(f), float(b)) for o, f, b in self.op_overheads))
        object.__setattr__(self, "op_rates", tuple(
            (str(o), float(f), float(b), float(r)) for o, f, b, r in self.op_rates))

    def for_stages(self, num_stages: int) -> DeviceSpec:
        """The spec a plan of ``num_stages`` stages is priced with: past one stage the ops
        run ``pipelined_scale`` times slower (both in-place factors), which is then spent
        (1.0), so a plan's recorded spec is never scaled twice."""
        if num_stages <= 1 or self.pipelined_scale == 1.0:
            return self
        s = self.pipelined_scale
        return dataclasses.replace(self, compute_scale=self.compute_scale * s,
                                   overhead_scale=self.overhead_scale * s,
                                   pipelined_scale=1.0)

    def peak_flops(self, dtype: str = "float32") -> float:
        """Peak FLOP/s for a value dtype name (half types use the bf16 tensor-core peak)."""
        return self.peak_flops_bf16 if dtype in ("bfloat16", "float16") else self.peak_flops_fp32

    def matmul_fraction(self, smallest_dim: float) -> float:
        """Fraction of peak FLOP/s a matmul reaches when its smallest dimension is this."""
        return _interp_log(self.matmul_efficiency, max(float(smallest_dim), 1.0))

    def bandwidth(self, nbytes: float) -> float:
        """Bytes/s an element-wise op moving ``nbytes`` reaches."""
        return self.mem_bandwidth * _interp_log(self.elementwise_efficiency,
                                                max(float(nbytes), 1.0))

    def op_overhead(self, op: str) -> tuple[float, float]:
        """(forward, backward) fixed seconds of one ``op`` (``"default"`` if not listed)."""
        table = {name: (f, b) for name, f, b in self.op_overheads}
        return table.get(op, table.get("default", (0.0, 0.0)))

    def op_rate(self, kind: str) -> tuple[float, float, float] | None:
        """(forward s, backward s per unit, reference size) of an op kind, if measured."""
        for name, fwd, bwd, ref in self.op_rates:
            if name == kind:
                return fwd, bwd, ref
        return None

    def optimizer_time(self, tensors: int, nbytes: float) -> float:
        """Seconds of one optimizer step over ``tensors`` parameters of ``nbytes`` bytes."""
        if tensors <= 0:
            return 0.0
        return tensors * self.optimizer_tensor_s + float(nbytes) * self.optimizer_byte_s

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "")

    def to_json(self) -> dict[str, Any]:
        data = versioned_json(self, SCHEMA_VERSION)
        data["sources"] = dict(self.sources)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceSpec:
        """Rebuild a spec from ``to_json`` output; another schema or field is an error."""
        d = dict(data)
        version = d.pop("schema_version", None)
        if version != SCHEMA_VERSION:
            raise SMPConfigError.build(
                "unsupported DeviceSpec schema_version", version, "DeviceSpec.from_json",
                f"this smp-fx reads schema {SCHEMA_VERSION}: re-run `smp-fx calibrate` "
                "(or use a built-in spec name)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        missing = sorted(f.name for f in fields(cls) if f.name not in d
                         and f.default is MISSING and f.default_factory is MISSING)
        if unknown or missing:
            raise SMPConfigError.build("a DeviceSpec has exactly the documented fields",
                                       {"unknown": unknown, "missing": missing},
                                       "DeviceSpec.from_json", "re-run `smp-fx calibrate`")
        for key in ("matmul_efficiency", "elementwise_efficiency", "op_overheads", "op_rates"):
            d[key] = tuple(tuple(row) for row in d.get(key, ()))
        d["sources"] = tuple(sorted(dict(d.get("sources", {})).items()))
        return cls(**d)

    def with_sources(self, **notes: str) -> DeviceSpec:
        """A copy whose ``sources`` also hold ``notes`` (field name -> where from)."""
        merged = {**dict(self.sources), **notes}
        return dataclasses.replace(self, sources=tuple(sorted(merged.items())))


GB = 1e9
GiB = 1024**3

_DATASHEET = {
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)",
    "v100": "NVIDIA V100 Tensor Core GPU datasheet (SXM2 32GB)",
}
# Rounded estimates, the same for the three GPUs; `smp-fx calibrate` on the GPU measures them.
_GPU_MATMUL: Table = ((16.0, 0.03), (64.0, 0.15), (256.0, 0.5), (1024.0, 0.8), (4096.0, 0.9))
_GPU_ELEMENTWISE: Table = ((1e5, 0.1), (1e7, 0.6), (1e8, 0.85))
_GPU_OPS: OpOverheads = (
    ("default", 11e-6, 15e-6), ("module", 3e-6, 0.0), ("view", 3.5e-6, 7e-6),
    ("linear", 20e-6, 90e-6), ("matmul", 15e-6, 60e-6), ("bmm", 18e-6, 60e-6),
    ("conv", 18e-6, 47e-6), ("layer_norm", 19e-6, 50e-6), ("batch_norm", 27e-6, 56e-6),
    ("embedding", 12e-6, 54e-6), ("softmax", 11.5e-6, 23e-6), ("sdpa", 20e-6, 80e-6),
    ("gelu", 9.5e-6, 17e-6), ("relu", 10.5e-6, 17e-6), ("tanh", 9.5e-6, 18e-6))
_GPU_OVERHEAD_SCALE = 1.5
_H100_HOST = ("measured by smp-fx calibrate on an H100 80GB HBM3 machine (torch 2.11+cu130, "
              "one process; the mean of two runs, 2026-11-26, rounded); host time, so a "
              "faster or slower host CPU moves it, and the other GPUs get the H100's")
_GPU_SOURCES = {
    "matmul_efficiency": "estimate, after the GEMM throughput-versus-size curves of NVIDIA's "
                         "'Matrix Multiplication Background User's Guide'; not measured",
    "elementwise_efficiency": "estimate: small kernels are launch-bound, large streaming "
                              "kernels reach about 85-90% of HBM peak; not measured",
    "op_overheads": f"{_H100_HOST}: eager PyTorch's launch, dispatch and autograd "
                    "bookkeeping per op, which bounds small models' steps",
    "overhead_scale": f"{_H100_HOST}: fitted on the reference transformer (1.27 and 1.83)",
    "link_latency_s": "order of magnitude of NCCL point-to-point small-message latency "
                      "over NVLink (nccl-tests sendrecv_perf); not a datasheet figure",
    "message_overhead_s": "estimate: host time to enqueue one NCCL send or receive",
    "microbatch_overhead_s": "order of magnitude of the smp-fx runtime per action from "
                             "smp-fx calibrate on the 2-core development CPU (host Python; "
                             "a GPU host's CPU is faster)",
    "step_overhead_s": "order of magnitude of the smp-fx runtime per step from smp-fx "
                       "calibrate on the 2-core development CPU",
    "optimizer_tensor_s": f"{_H100_HOST}: torch.optim.Adam's default (foreach) step, "
                          "11.5 and 12.8 us per tensor",
    "optimizer_byte_s": "Adam streams 7 bytes per parameter byte (read param, grad, two "
                        "moments; write param, two moments) at mem_bandwidth",
}


def _gpu(name: str, fp32: float, bf16: float, bandwidth: float, memory: int,
         link: float) -> DeviceSpec:
    sheet = _DATASHEET[name]
    sheet_fields = ("peak_flops_fp32", "peak_flops_bf16", "mem_bandwidth", "memory_bytes")
    sources = {**_GPU_SOURCES, **{k: sheet for k in sheet_fields},
               "link_bandwidth": f"{sheet}: NVLink total bandwidth / 2 (one direction)"}
    return DeviceSpec(name, fp32, bf16, bandwidth, memory, link, 5e-6,
                      matmul_efficiency=_GPU_MATMUL, elementwise_efficiency=_GPU_ELEMENTWISE,
                      op_overheads=_GPU_OPS, message_overhead_s=10e-6,
                      microbatch_overhead_s=100e-6, step_overhead_s=100e-6,
                      optimizer_tensor_s=12e-6, optimizer_byte_s=7.0 / bandwidth,
                      overhead_scale=_GPU_OVERHEAD_SCALE,
                      sources=tuple(sorted(sources.items())))


H100 = _gpu("h100", 67e12, 989.4e12, 3.35e12, 80 * GiB, 450 * GB)
A100 = _gpu("a100", 19.5e12, 312e12, 2.039e12, 80 * GiB, 300 * GB)
V100 = _gpu("v100", 15.7e12, 125e12, 0.9e12, 32 * GiB, 150 * GB)

_FIXED: dict[str, DeviceSpec] = {s.name: s for s in (H100, A100, V100)}


def device_names() -> tuple[str, ...]:
    return (*_FIXED, "cpu")


def get_device(name: str) -> DeviceSpec:
    """A spec by name: "h100", "a100", "v100" (datasheet) or "cpu" (measured here, quick).

    >>> get_device("a100").link_bandwidth
    300000000000.0
    """
    key = name.lower()
    if key == "cpu":
        from cost_model.calibrate import quick_cpu_spec

        return quick_cpu_spec()
    if key not in _FIXED:
        raise SMPConfigError.build("unknown device spec name", name, "cost_model.get_device",
                                   f"use one of {list(device_names())}, a spec file "
                                   "written by `smp-fx calibrate`, or build a DeviceSpec")
    return _FIXED[key]


def load_device(name_or_path: str) -> DeviceSpec:
    """A built-in spec by name, or a spec JSON file (``smp-fx calibrate -o FILE.json``)."""
    if name_or_path.lower() in device_names():
        return get_device(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise SMPConfigError.build("a device spec is a built-in name or a JSON file",
                                   name_or_path, "device spec",
                                   f"use one of {list(device_names())} or write a file with "
                                   "`smp-fx calibrate -o FILE.json`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise SMPConfigError.build("a device spec file must hold a JSON object", str(exc),
                                   str(path), "re-run `smp-fx calibrate -o FILE.json`") from exc
    if not isinstance(data, dict):
        raise SMPConfigError.build("a device spec file must hold a JSON object",
                                   type(data).__name__, str(path), "re-run smp-fx calibrate")
    return DeviceSpec.from_json(data)


def spec_for_device_name(device_name: str) -> str | None:
    """The built-in spec for an accelerator's marketing name (``torch.cuda.get_device_name``):
    "NVIDIA H100 80GB HBM3" -> "h100"; ``None`` if no built-in matches."""
    upper = device_name.upper()
    for key in _FIXED:
        if key.upper() in upper:
            return key
    return None
