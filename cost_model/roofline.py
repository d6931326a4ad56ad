"""Time from work: the roofline ``max(flops / peak, bytes / bandwidth)`` and link time.

Deliberately simple: per node the compute and memory terms do not overlap across nodes,
and kernel launch overheads are ignored (they matter for tiny models, which is what
``trace_execution_times`` is for).
"""

from __future__ import annotations

from cost_model.device import DeviceSpec
from cost_model.errors import SMPInternalError


def roofline_time(flops: float, nbytes: float, spec: DeviceSpec, dtype: str = "float32") -> float:
    """Seconds to do ``flops`` FLOPs touching ``nbytes`` bytes of memory on ``spec``."""
    if flops < 0 or nbytes < 0:
        raise SMPInternalError.build("flops and bytes must be >= 0", (flops, nbytes),
                                     "cost_model.roofline_time")
    return max(flops / spec.peak_flops(dtype), nbytes / spec.mem_bandwidth)


def comm_time(nbytes: float, spec: DeviceSpec) -> float:
    """Seconds to send ``nbytes`` over one link: latency + bytes / link bandwidth (0 for 0)."""
    if nbytes < 0:
        raise SMPInternalError.build("bytes sent must be >= 0", nbytes, "cost_model.comm_time")
    if nbytes == 0:
        return 0.0
    return spec.link_latency_s + nbytes / spec.link_bandwidth
