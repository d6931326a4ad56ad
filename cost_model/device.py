"""Device specs as data: a plan can be made for a cluster one does not have.

A ``DeviceSpec`` is everything the cost model knows about one accelerator, its link and
the runtime on its host; it is the one source of link costs for partitioner, plan and
simulator. The built-in "cpu" spec is measured per process, so analytic tests and golden
plans use a fixed spec. See docs/planning.md, 'Device specs'.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from cost_model.errors import SMPConfigError
from cost_model.serial import versioned_json

SCHEMA_VERSION = 2
"""The spec a plan is made for when the caller names none."""

Table = tuple[tuple[float, float], ...]
OpOverheads = tuple[tuple[str, float, float], ...]
OpRates = tuple[tuple[str, float, float, float], ...]
AttentionRates = tuple[tuple[float, ...], ...]
"""Rows (key length, forward, backward FLOP/s[, head dimension]):
``DeviceSpec.attention_rates``."""


def interp_log(table: Table, x: float) -> float:
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

    Every field beyond the peaks defaults to the ideal (no overhead, full efficiency);
    docs/planning.md, 'Device specs', says what each one prices."""

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
    attention_rates: AttentionRates = ()
    """(key sequence length, forward, backward FLOP/s on full-square FLOPs, head dimension)
    of causal fused attention, sorted by head dimension, then length; where given,
    ``sdpa`` runs at these (log-interpolated in both), not at ``op_rates``' one reference
    size: published kernels run faster on longer sequences and wider heads. A row without
    its fourth entry holds at every head dimension."""
    sm_count: int = 0
    """Streaming multiprocessors: a GEMM's output tiles run in waves of this many
    (``cost_model.waves``); 0 where not known, and GEMMs are priced by
    ``matmul_efficiency`` alone."""
    gemm_tile: tuple[int, ...] = ()
    """(rows, columns) of the output tile the vendor's library runs large half-precision
    GEMMs with; () where not known."""
    matmul_shapes: str = ""
    """The shapes ``matmul_efficiency`` was measured on, so that the table's own wave
    quantization is divided out (``cost_model.waves.table_quantization``): ``"linear:B"``
    (``cost_model.microbench.matmul_table``: the smallest dimension in each of a linear's
    three places against B), ``"cube"`` (d x d x d), or ``""`` (a fitted or estimated
    table, taken to carry no quantization of its own)."""
    peak_flops_fp8: float = 0.0
    """Dense FP8 tensor-core FLOP/s; 0 where the device has none (before Hopper). What a
    GEMM marked to run in FP8 (``passes.meta.GEMM_DTYPE``) is priced against, at
    ``matmul_efficiency``'s fraction."""
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> SMPConfigError:
            return SMPConfigError.build(rule, getattr(self, name), f"DeviceSpec.{name}",
                                        "re-run smp-fx calibrate or fix the spec file")

        for name in ("peak_flops_fp32", "peak_flops_bf16", "mem_bandwidth", "link_bandwidth",
                     "compute_scale", "overhead_scale", "pipelined_scale"):
            if not float(getattr(self, name)) > 0:
                raise bad(name, f"{name} must be > 0")
        if not float(self.peak_flops_fp8) >= 0:
            raise bad("peak_flops_fp8", "peak_flops_fp8 must be >= 0 (0: no FP8 tensor cores)")
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
        rates = tuple(tuple(float(x) for x in ((*r, 0.0) if len(r) == 3 else r))
                      for r in self.attention_rates)  # a row without a head dimension: 0
        if any(len(r) != 4 or min(r[:3]) <= 0 or r[3] < 0 for r in rates) or \
                [(r[3], r[0]) for r in rates] != sorted((r[3], r[0]) for r in rates) or \
                (len({r[3] for r in rates}) > 1 and any(r[3] == 0 for r in rates)):
            raise bad("attention_rates", "attention_rates needs (length > 0, forward > 0, "
                      "backward > 0[, head dimension > 0]) rows sorted by head dimension, "
                      "then length; every row with a head dimension, or none")
        object.__setattr__(self, "attention_rates", rates)
        if int(self.sm_count) < 0:
            raise bad("sm_count", "sm_count must be >= 0 (0: not known)")
        tile = tuple(int(x) for x in self.gemm_tile)
        if tile and (len(tile) != 2 or min(tile) <= 0):
            raise bad("gemm_tile", "gemm_tile needs (rows > 0, columns > 0), or ()")
        object.__setattr__(self, "sm_count", int(self.sm_count))
        object.__setattr__(self, "gemm_tile", tile)
        shapes = self.matmul_shapes
        if shapes not in ("", "cube") and not (
                shapes.startswith("linear:") and shapes[7:].isdigit() and int(shapes[7:]) > 0):
            raise bad("matmul_shapes", 'matmul_shapes is "", "cube" or "linear:B" (B > 0)')
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
        """Peak FLOP/s for a value dtype name (half types use the bf16 tensor-core peak,
        ``float8*`` the FP8 one: an error on a device without FP8 tensor cores)."""
        if dtype.startswith("float8"):
            if not self.peak_flops_fp8:
                raise SMPConfigError.build(
                    "FP8 GEMMs need FP8 tensor cores", self.name, "DeviceSpec.peak_flops_fp8",
                    "plan in bf16 on this device, or give its spec a peak_flops_fp8")
            return self.peak_flops_fp8
        return self.peak_flops_bf16 if dtype in ("bfloat16", "float16") else self.peak_flops_fp32

    def matmul_fraction(self, smallest_dim: float) -> float:
        """Fraction of peak FLOP/s a matmul reaches when its smallest dimension is this."""
        return interp_log(self.matmul_efficiency, max(float(smallest_dim), 1.0))

    def bandwidth(self, nbytes: float) -> float:
        """Bytes/s an element-wise op moving ``nbytes`` reaches."""
        return self.mem_bandwidth * interp_log(self.elementwise_efficiency,
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

    def attention_rate(self, seq: float, head_dim: float | None = None
                       ) -> tuple[float, float] | None:
        """(forward, backward) FLOP/s of causal fused attention over ``seq`` keys at
        ``head_dim`` (log-interpolated between the published head dimensions, clamped;
        unknown: the widest published), if the spec has published rates by length
        (``attention_rates``)."""
        if not self.attention_rates:
            return None
        groups: dict[float, list[tuple[float, ...]]] = {}
        for row in self.attention_rates:
            groups.setdefault(row[3], []).append(row)
        x = max(float(seq), 1.0)
        by_dim = tuple((d, (interp_log(tuple((r[0], r[1]) for r in rows), x),
                            interp_log(tuple((r[0], r[2]) for r in rows), x)))
                       for d, rows in sorted(groups.items()))
        if len(by_dim) == 1 or not head_dim:
            return by_dim[-1][1]
        dim = float(head_dim)
        return (interp_log(tuple((d, f) for d, (f, _) in by_dim), dim),
                interp_log(tuple((d, b) for d, (_, b) in by_dim), dim))

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
        for name in ("attention_rates", "sm_count", "gemm_tile", "matmul_shapes",
                     "peak_flops_fp8"):
            if not data[name]:  # optional: specs without them read as before
                del data[name]
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
        for key in ("matmul_efficiency", "elementwise_efficiency", "op_overheads", "op_rates",
                    "attention_rates"):
            d[key] = tuple(tuple(row) for row in d.get(key, ()))
        d["gemm_tile"] = tuple(d.get("gemm_tile", ()))
        d["sources"] = tuple(sorted(dict(d.get("sources", {})).items()))
        return cls(**d)

    def with_sources(self, **notes: str) -> DeviceSpec:
        """A copy whose ``sources`` also hold ``notes`` (field name -> where from)."""
        merged = {**dict(self.sources), **notes}
        return dataclasses.replace(self, sources=tuple(sorted(merged.items())))


GB = 1e9
GiB = 1024**3
