"""Time from work: a roofline with size-dependent efficiency, fixed op costs, link time.

A node's time is ``fixed + max(compute, memory)``: the two terms of one op overlap, those
of different ops do not; the fixed part dominates small models. See docs/planning.md,
'Device specs'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from cost_model.device import DeviceSpec
from cost_model.errors import SMPInternalError
from cost_model.flops import ELEMENTWISE_COST, REDUCTION_OPS, VIEW_OPS
from cost_model.waves import Gemm, gemm_factors

KIND = {
    "addmm": "linear", "mm": "matmul", "baddbmm": "bmm", "einsum_mm": "matmul",
    "grouped_mm": "matmul",
    "log_softmax": "softmax", "native_layer_norm": "layer_norm", "group_norm": "layer_norm",
    "rms_norm": "layer_norm", "threshold": "relu", "hardtanh": "relu", "leaky_relu": "relu",
    "silu": "gelu", "sigmoid": "tanh", "exp": "tanh", "log": "tanh", "erf": "tanh",
    "pow": "tanh", "sqrt": "tanh", "rsqrt": "tanh",
}
"""Ops priced like a measured kind (``cost_model.calibrate``); other element-wise ops and
reductions are priced like ``"default"`` (a multiply by a scalar)."""
GEMM_KINDS = frozenset({"linear", "matmul", "bmm", "conv", "sdpa"})
"""Kinds whose work is counted in FLOPs; the others' in output elements."""


def _check(flops: float, nbytes: float) -> None:
    if flops < 0 or nbytes < 0:
        raise SMPInternalError.build("flops and bytes must be >= 0", (flops, nbytes),
                                     "cost_model.roofline")


def roofline_time(flops: float, nbytes: float, spec: DeviceSpec, dtype: str = "float32",
                  gemm_dim: float | None = None, waves: float = 1.0) -> float:
    """Seconds to do ``flops`` FLOPs touching ``nbytes`` bytes on ``spec`` (no fixed cost);
    ``waves``: the GEMM's wave-quantization factor (``cost_model.waves.gemm_factors``).

    >>> from cost_model.device import DeviceSpec
    >>> s = DeviceSpec("x", 1e9, 1e9, 1e9, 1, 1e9, 0.0, matmul_efficiency=((8, .5), (64, 1.)))
    >>> roofline_time(1e9, 0, s), roofline_time(1e9, 0, s, gemm_dim=8)
    (1.0, 2.0)
    """
    _check(flops, nbytes)
    peak = spec.peak_flops(dtype)
    if gemm_dim is not None:
        peak *= spec.matmul_fraction(gemm_dim) * waves
    memory = nbytes / spec.bandwidth(nbytes) if nbytes else 0.0
    return max(flops / peak, memory)


def kind_of(op: str) -> str:
    """The measured kind an op is priced as (``"view"`` for ops that move no data)."""
    if op in VIEW_OPS:
        return "view"
    kind = KIND.get(op, op)
    if kind not in GEMM_KINDS and (op in ELEMENTWISE_COST or op in REDUCTION_OPS) and kind \
            not in ("relu", "gelu", "tanh", "softmax"):
        return "default"
    return kind


def op_overhead(op: str, spec: DeviceSpec, *, module: bool = False) -> tuple[float, float]:
    """(forward, backward) fixed seconds of one op; ``module``: called as an fx leaf module."""
    fwd, bwd = spec.op_overhead(kind_of(op))
    if module:
        fwd += spec.op_overhead("module")[0]
    return fwd, bwd


def node_times(op: str, spec: DeviceSpec, *, fwd_flops: float, bwd_flops: float,
               out_elems: float, moved: float, dtype: str = "float32",
               gemm_dim: float | None = None, module: bool = False,
               backward: bool = True, seq: float | None = None,
               head_dim: float | None = None, gemm: Gemm | None = None
               ) -> tuple[float, float]:
    """(forward, backward) seconds of one node: its fixed cost plus its work (a measured rate
    where the spec has one, else the roofline), scaled by the spec's in-model factors;
    ``seq``, ``head_dim``: an attention's key length and head dimension
    (``DeviceSpec.attention_rates``); ``gemm``: the GEMM's shape, priced with its waves
    (``cost_model.waves``) where the spec has an SM count (its smallest dimension is then
    ``gemm_dim``)."""
    fixed_f, fixed_b = op_overhead(op, spec, module=module)
    if gemm is not None:
        gemm_dim = min(gemm.m, gemm.k, gemm.n)
    waves = gemm_factors(gemm, spec) if gemm is not None else (1.0, 1.0)
    work_f, work_b = _work(op, spec, fwd_flops=fwd_flops, bwd_flops=bwd_flops,
                           out_elems=out_elems, moved=moved, dtype=dtype, gemm_dim=gemm_dim,
                           seq=seq, head_dim=head_dim, waves=waves)
    fwd = fixed_f * spec.overhead_scale + work_f * spec.compute_scale
    bwd = fixed_b * spec.overhead_scale + work_b * spec.compute_scale
    return fwd, bwd if backward else 0.0


def _work(op: str, spec: DeviceSpec, *, fwd_flops: float, bwd_flops: float,
          out_elems: float, moved: float, dtype: str, gemm_dim: float | None,
          seq: float | None = None, head_dim: float | None = None,
          waves: tuple[float, float] = (1.0, 1.0)) -> tuple[float, float]:
    """(forward, backward) seconds of the node's work, its fixed cost left out."""
    kind = kind_of(op)
    if kind == "view":
        return 0.0, 0.0
    by_length = spec.attention_rate(seq, head_dim) if kind == "sdpa" and seq else None
    if by_length is not None:
        return fwd_flops / by_length[0], bwd_flops / by_length[1]
    rate = spec.op_rate(kind)
    if rate is not None:
        fwd_rate, bwd_rate, ref = rate
        if kind in GEMM_KINDS:
            units_f, units_b = fwd_flops, bwd_flops
            scale = spec.matmul_fraction(ref) / spec.matmul_fraction(gemm_dim or ref)
        else:
            units_f = units_b = out_elems
            scale = spec.bandwidth(ref) / spec.bandwidth(moved) if moved and ref else 1.0
        return (units_f * fwd_rate * scale / waves[0],
                units_b * bwd_rate * scale / waves[1])
    return (roofline_time(fwd_flops, moved, spec, dtype, gemm_dim, waves[0]),
            roofline_time(bwd_flops, 2 * moved, spec, dtype, gemm_dim, waves[1]))


FP8_CAST_BYTES = 4.0
"""Bytes an element of an FP8 GEMM's operand moves to be cast: Transformer Engine's
cast-transpose reads it in bf16 (2) and writes it in FP8 twice (1 + 1: as is, and
transposed for the GEMM that reads it the other way round)."""


def fp8_cast_times(in_elems: float, out_elems: float, spec: DeviceSpec
                   ) -> tuple[float, float]:
    """(forward, backward) seconds an FP8 linear spends casting its operands, besides its
    GEMMs: its input in the forward (``in_elems``: 0 where another FP8 linear cast the same
    input, as q, k and v share theirs), its output gradient in the backward, each
    ``FP8_CAST_BYTES`` an element at the device's element-wise bandwidth. The weight's
    cast, once a step for every microbatch, is not counted; nor is the saving where a
    recipe fuses the cast into the op before (a layer norm's output): an upper bound on
    the casts' traffic."""
    return (roofline_time(0.0, FP8_CAST_BYTES * in_elems, spec) * spec.compute_scale,
            roofline_time(0.0, FP8_CAST_BYTES * out_elems, spec) * spec.compute_scale)


def comm_time(nbytes: float, spec: DeviceSpec) -> float:
    """Seconds to send ``nbytes`` over one link: latency + bytes / link bandwidth (0 for 0)."""
    _check(0.0, nbytes)
    if nbytes == 0:
        return 0.0
    return spec.link_latency_s + nbytes / spec.link_bandwidth


def link_time(nbytes: float, spec: DeviceSpec) -> float:
    """How long a message keeps the link busy: bytes / bandwidth (latency delays arrival
    but does not occupy the link)."""
    _check(0.0, nbytes)
    return nbytes / spec.link_bandwidth if nbytes > 0 else 0.0


def link_model(spec: DeviceSpec) -> tuple[Callable[[float], float], Callable[[float], float]]:
    """(``comm_time``, ``link_time``) of ``spec`` as functions of bytes: what the
    partitioner's objective takes (``passes.partitioning.problem.make_objective``)."""
    return functools.partial(comm_time, spec=spec), functools.partial(link_time, spec=spec)
