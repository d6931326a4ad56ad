"""Wave quantization: a GEMM whose output tiles fill the SMs in a fractional number of waves.

Why: a GPU runs a GEMM's output tiles one per SM at a time, in waves of ``sm_count``; a
last wave that is partly empty takes as long as a full one, so the GEMM runs at
``waves / ceil(waves)`` of the rate a whole number of waves would reach (NVIDIA's 'Matrix
Multiplication Background User's Guide', 'Wave Quantization'). ``matmul_efficiency`` is
indexed by the smallest dimension alone and was measured on shapes of its own
(``DeviceSpec.matmul_shapes``), so it carries their quantization: a GEMM is priced at the
table's figure times its own quantization over the table's (``gemm_factors``), never
twice. See docs/planning.md, 'Device specs'.

Model limits, as priced: a shape of fewer tiles than SMs counts as unquantized (1.0), for
the GEMM and for the table's shapes alike: there cuBLAS's heuristics run smaller tiles or
split the contraction, which the table's own small sizes measured; the backward of a GEMM
is two GEMMs of its FLOPs each, the input gradient (m x k) and the weight gradient (n x k).

>>> from cost_model.gpu_specs import H100_SXM
>>> f, b = gemm_factors(Gemm(4096, 7168, 2688), H100_SXM)  # 352 tiles: 2.67 waves of 132
>>> round(f, 3)  # 2.67 / 3 over the table's own 0.977 at 2688
0.909
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cost_model.device import DeviceSpec, interp_log

WAVE_OPS = frozenset({"linear", "addmm", "mm", "matmul", "einsum_mm", "bmm", "baddbmm"})
"""Ops priced with their waves: one library GEMM each (a batch of them for ``bmm``). Fused
attention (``sdpa``: its own kernels and tiling, priced by published rates), grouped
expert GEMMs and convolutions are priced by the table alone."""


@dataclass(frozen=True)
class Gemm:
    """``batch`` GEMMs of an (m x k) by (k x n) product: the output is m x n."""

    m: int
    k: int
    n: int
    batch: int = 1

    def shard(self, k_parts: int = 1, n_parts: int = 1) -> Gemm:
        """This GEMM on one of the ranks that split its contraction (``k_parts``: a row
        linear) or its outputs (``n_parts``: a column linear)."""
        return Gemm(self.m, -(-self.k // k_parts), -(-self.n // n_parts), self.batch)


def wave_gemm(op: str, dims: tuple[int, int, int] | None,
              out_shape: tuple[int, ...] | None) -> Gemm | None:
    """The ``Gemm`` a ``WAVE_OPS`` op runs, from its (m, k, n) (``cost_model.flops.gemm_dims``)
    and output shape (the batch: output elements over m x n); ``None`` for other ops.

    >>> wave_gemm("bmm", (128, 64, 128), (32, 128, 128))
    Gemm(m=128, k=64, n=128, batch=32)
    """
    if op not in WAVE_OPS or dims is None or min(dims) <= 0:
        return None
    m, k, n = dims
    batch = math.prod(out_shape) // (m * n) if out_shape else 1
    return Gemm(m, k, n, max(1, batch))


def tiles(rows: int, cols: int, tile: tuple[int, ...], batch: int = 1) -> int:
    """Output tiles of a ``rows`` x ``cols`` output in ``tile``-shaped pieces, per batch."""
    return batch * -(-rows // tile[0]) * -(-cols // tile[1])


def wave_efficiency(count: int, sms: int) -> float:
    """The share of ``ceil(waves)`` the ``count`` tiles keep busy: waves / ceil(waves).

    >>> wave_efficiency(264, 132), round(wave_efficiency(352, 132), 4), wave_efficiency(1, 4)
    (1.0, 0.8889, 0.25)
    """
    waves = count / sms
    return waves / math.ceil(waves)


def quantization(rows: int, cols: int, spec: DeviceSpec, batch: int = 1) -> float:
    """``wave_efficiency`` of an output on ``spec``; 1.0 where it has fewer tiles than SMs
    (module docstring) or the spec has no SM count or tile."""
    if not spec.sm_count or not spec.gemm_tile:
        return 1.0
    count = tiles(rows, cols, spec.gemm_tile, batch)
    return 1.0 if count < spec.sm_count else wave_efficiency(count, spec.sm_count)


def _measured_at(d: float, spec: DeviceSpec) -> float:
    """The quantization of the shapes ``matmul_efficiency``'s entry at ``d`` was measured
    on: a cube, or a linear's three placements timed together (``matmul_table``)."""
    size = int(d)
    if spec.matmul_shapes == "cube":
        return quantization(size, size, spec)
    big = int(spec.matmul_shapes.split(":")[1])
    if size >= big:
        return quantization(size, size, spec)
    outputs = ((size, big), (big, big), (big, size))  # (d, B, B), (B, d, B), (B, B, d)
    return len(outputs) / sum(1.0 / quantization(r, c, spec) for r, c in outputs)


def table_quantization(smallest_dim: float, spec: DeviceSpec) -> float:
    """The quantization ``matmul_efficiency`` carries at ``smallest_dim``: its entries'
    own, interpolated as the table is (1.0 for a fitted or estimated table)."""
    if not spec.matmul_shapes or not spec.matmul_efficiency:
        return 1.0
    own = tuple((x, _measured_at(x, spec)) for x, _ in spec.matmul_efficiency)
    return interp_log(own, max(float(smallest_dim), 1.0))


def gemm_factors(g: Gemm, spec: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) factors on ``matmul_efficiency``'s figure for ``g``: its own
    quantization over the table's at its smallest dimension; (1.0, 1.0) on a spec without
    an SM count (a CPU, a calibrated or user's spec)."""
    if not spec.sm_count or not spec.gemm_tile:
        return 1.0, 1.0
    ref = table_quantization(min(g.m, g.k, g.n), spec)
    fwd = quantization(g.m, g.n, spec, g.batch)
    dgrad = quantization(g.m, g.k, spec, g.batch)
    wgrad = quantization(g.n, g.k, spec, g.batch)
    return fwd / ref, 2.0 / (1.0 / dgrad + 1.0 / wgrad) / ref


__all__ = ["WAVE_OPS", "Gemm", "gemm_factors", "quantization", "table_quantization", "tiles",
           "wave_efficiency", "wave_gemm"]
