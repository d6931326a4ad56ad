"""Time from work: a roofline with size-dependent efficiency, fixed op costs, link time.

A node's time is ``fixed + max(flops / (peak * matmul fraction), bytes / bandwidth)``:
the compute and memory terms of one op overlap, those of different ops do not. The
matmul fraction depends on the smallest matmul dimension and the bandwidth on the bytes
moved (``DeviceSpec.matmul_efficiency`` / ``elementwise_efficiency``); the fixed part is
the op's dispatch, launch and autograd bookkeeping (``DeviceSpec.op_overheads``), which
dominates small models. Link time is the spec's too: one link model for partitioner,
plan and simulator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from cost_model.device import DeviceSpec
from cost_model.errors import SMPConfigError
from cost_model.flops import VIEW_OPS

OVERHEAD_KIND = {
    "addmm": "linear", "mm": "matmul", "baddbmm": "bmm", "einsum_mm": "matmul",
    "log_softmax": "softmax", "native_layer_norm": "layer_norm", "group_norm": "layer_norm",
    "rms_norm": "layer_norm", "threshold": "relu", "hardtanh": "relu", "leaky_relu": "relu",
}
"""Ops priced like a measured kind (``cost_model.calibrate.OP_KINDS``)."""


def _check(flops: float, nbytes: float) -> None:
    if flops < 0 or nbytes < 0:
        raise SMPConfigError.build("flops and bytes must be >= 0", (flops, nbytes),
                                   "cost_model.roofline", "pass non-negative amounts")


def roofline_time(flops: float, nbytes: float, spec: DeviceSpec, dtype: str = "float32",
                  gemm_dim: float | None = None) -> float:
    """Seconds to do ``flops`` FLOPs touching ``nbytes`` bytes on ``spec`` (no fixed cost).

    ``gemm_dim`` is the smallest dimension of the matmul(s) doing the FLOPs (None: not a
    matmul, the peak applies).

    >>> from cost_model.device import DeviceSpec
    >>> s = DeviceSpec("x", 1e9, 1e9, 1e9, 1, 1e9, 0.0, matmul_efficiency=((8, .5), (64, 1.)))
    >>> roofline_time(1e9, 0, s), roofline_time(1e9, 0, s, gemm_dim=8)
    (1.0, 2.0)
    """
    _check(flops, nbytes)
    peak = spec.peak_flops(dtype)
    if gemm_dim is not None:
        peak *= spec.matmul_fraction(gemm_dim)
    memory = nbytes / spec.bandwidth(nbytes) if nbytes else 0.0
    return max(flops / peak, memory)


def op_overhead(op: str, spec: DeviceSpec, *, module: bool = False) -> tuple[float, float]:
    """(forward, backward) fixed seconds of one op; ``module``: called as an fx leaf module."""
    kind = "view" if op in VIEW_OPS else OVERHEAD_KIND.get(op, op)
    fwd, bwd = spec.op_overhead(kind)
    if module:
        fwd += spec.op_overhead("module")[0]
    return fwd, bwd


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
