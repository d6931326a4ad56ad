"""Measure the machine this process runs on into a ``DeviceSpec``.

The runtime's own costs (per action, per step) need the runtime, which this layer may not
import: ``smp-fx calibrate`` fits them. See docs/cli.md, 'smp-fx calibrate'.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import torch
import torch.distributed as dist

from cost_model.device import DeviceSpec, GiB, OpRates
from cost_model.microbench import (
    ACCELERATOR,
    FULL,
    QUICK,
    Budget,
    host_overlaps,
    measure_elementwise,
    measure_link,
    measure_matmul,
    measure_op_costs,
    measure_optimizer,
)
from cost_model.model_sizes import ModelSizes, at_model_sizes
from cost_model.roofline import GEMM_KINDS

ADAM_OPS, ADAM_BYTES = 12, 16.0
"""A single-tensor Adam step: about 12 ops per tensor moving 16 bytes per parameter byte
(lerp, mul, addcmul, sqrt, div, addcdiv, the step counter); the quick estimate."""

NO_WAVES = ("not known (0): GEMMs are priced by matmul_efficiency alone, without wave "
            "quantization (cost_model.waves); a spec file may set sm_count and gemm_tile")
LOOPBACK = DeviceSpec(
    "cpu", 1e11, 1e11, 1e10, 16 * GiB, 5e9, 50e-6, message_overhead_s=50e-6,
    microbatch_overhead_s=150e-6, step_overhead_s=500e-6,
    sources=(("link_bandwidth", "estimate for gloo over loopback; `smp-fx calibrate "
                                "--nproc 2` measures it"),
             ("link_latency_s", "estimate for gloo over loopback"),
             ("message_overhead_s", "estimate: posting a gloo send or receive costs "
                                    "30-90 us of a rank's time (docs/architecture.md)"),
             ("microbatch_overhead_s", "estimate of the smp-fx runtime per action on a "
                                       "small CPU; `smp-fx calibrate` measures it"),
             ("step_overhead_s", "estimate of the smp-fx runtime per step on a small CPU; "
                                 "`smp-fx calibrate` measures it"),
             ("sm_count", NO_WAVES)))
"""Starting point of a CPU calibration: what is not measured keeps these estimates."""


def _memory_bytes(device: torch.device) -> int:
    if device.type != "cpu":
        return int(torch.get_device_module(device).get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def calibrate(name: str = "cpu", device: torch.device | str = "cpu", *,
              quick: bool = False, base: DeviceSpec | None = None,
              sizes: ModelSizes | None = None) -> DeviceSpec:
    """Measure ``device`` into a ``DeviceSpec`` called ``name``; link and runtime figures
    stay ``base``'s. ``sizes``: then measure again at a model's sizes (``at_model_sizes``;
    on an accelerator, the 1.3B GPT's when None)."""
    device = torch.device(device)
    spec = _device_figures(name, device, quick, base)
    if sizes is None and host_overlaps(device):
        sizes = ModelSizes()
    if sizes is None:
        return spec
    return at_model_sizes(spec, device, sizes, _budget(device, quick))


def _device_figures(name: str, device: torch.device, quick: bool,
                    base: DeviceSpec | None) -> DeviceSpec:
    budget = _budget(device, quick)
    ops, rates = measure_op_costs(budget, device)
    op_s = dict((k, f) for k, f, _ in ops)
    peak, peak_half, mm_table = measure_matmul(budget, device)
    rates = _at_most_peak(rates, peak)
    bandwidth, ew_table = measure_elementwise(budget, device)
    if quick:  # constructing the first optimizer imports for seconds: estimate it
        opt_tensor, opt_byte = ADAM_OPS * op_s["default"], ADAM_BYTES / bandwidth
    else:
        opt_tensor, opt_byte = measure_optimizer(budget, device)
    how = (f"measured by cost_model.calibrate ({'quick' if quick else 'full'}) on "
           f"{device.type}, {torch.get_num_threads()} thread(s)")
    start = base or LOOPBACK
    spec = dataclasses.replace(
        start, name=name, peak_flops_fp32=peak, peak_flops_bf16=peak_half,
        mem_bandwidth=bandwidth, memory_bytes=_memory_bytes(device),
        matmul_efficiency=mm_table, matmul_shapes=f"linear:{budget.matmul_big}",
        elementwise_efficiency=ew_table, op_overheads=ops,
        op_rates=rates,
        optimizer_tensor_s=opt_tensor, optimizer_byte_s=opt_byte)
    measured = ["peak_flops_fp32", "peak_flops_bf16", "mem_bandwidth", "memory_bytes",
                "matmul_efficiency", "elementwise_efficiency", "op_overheads", "op_rates"]
    estimate = (f"estimate: a single-tensor Adam step is about {ADAM_OPS} ops per tensor and "
                f"{ADAM_BYTES:.0f} bytes moved per parameter byte, at the measured op cost "
                "and bandwidth")
    optimizer = {k: estimate if quick else how for k in ("optimizer_tensor_s",
                                                         "optimizer_byte_s")}
    return spec.with_sources(**{k: how for k in measured}, **optimizer)


def _budget(device: torch.device, quick: bool) -> Budget:
    return QUICK if quick else FULL if device.type == "cpu" else ACCELERATOR


def _at_most_peak(rates: OpRates, peak: float) -> OpRates:
    """A matmul kind's work no faster than the peak: a kernel that hides under its launch
    (a GPU runs it while the host queues the next) times as almost free, and its fitted
    seconds per FLOP would price every matmul of that kind at nothing."""
    return tuple((k, max(f, 1.0 / peak), max(b, 1.0 / peak), ref) if k in GEMM_KINDS
                 else (k, f, b, ref) for k, f, b, ref in rates)


def with_link(spec: DeviceSpec, device: torch.device | str = "cpu", *, quick: bool = False,
              group: Any = None) -> DeviceSpec:
    """``spec`` with the link measured between ranks 0 and 1 of ``group`` (None: the
    default group; torch.distributed initialised, two or more ranks, every rank calls)."""
    budget = _budget(torch.device(device), quick)
    latency, bandwidth, per_message = measure_link(budget, torch.device(device), group)
    note = f"measured by cost_model.calibrate, {dist.get_backend(group)} between ranks 0 and 1"
    spec = dataclasses.replace(spec, link_latency_s=latency, link_bandwidth=bandwidth,
                               message_overhead_s=per_message)
    return spec.with_sources(link_latency_s=note, link_bandwidth=note, message_overhead_s=note)


@functools.lru_cache(maxsize=1)
def quick_cpu_spec() -> DeviceSpec:
    """The built-in "cpu" spec: a quick calibration of this CPU, once per process.

    The global RNG is restored afterwards so planning leaves the user's dropout stream."""
    with torch.random.fork_rng(devices=[]):
        return calibrate("cpu", "cpu", quick=True)


def figures(spec: DeviceSpec) -> list[tuple[str, str]]:
    """Human-readable (figure, value) rows of a spec, for the CLI."""
    rows = [("peak fp32", f"{spec.peak_flops_fp32 / 1e9:.1f} GFLOP/s"),
            ("memory bandwidth", f"{spec.mem_bandwidth / 1e9:.1f} GB/s"),
            ("link", f"{spec.link_bandwidth / 1e9:.2f} GB/s, "
                     f"{spec.link_latency_s * 1e6:.1f} us latency, "
                     f"{spec.message_overhead_s * 1e6:.1f} us per message"),
            ("runtime", f"{spec.microbatch_overhead_s * 1e6:.0f} us per action, "
                        f"{spec.step_overhead_s * 1e6:.0f} us per step"),
            ("optimizer (Adam)", f"{spec.optimizer_tensor_s * 1e6:.1f} us per tensor + "
                                 f"{spec.optimizer_byte_s * 1e12:.1f} ps per byte"),
            ("compute scale", f"{spec.compute_scale:.2f} x the op work below, "
                              f"{spec.overhead_scale:.2f} x the fixed costs (ops inside a "
                              "model against ops timed alone)"),
            ("pipelined scale", f"{spec.pipelined_scale:.2f} x both past one stage (the "
                                "ranks of a pipeline sharing this host)")]
    rows += [(f"matmul, smallest dim {int(d)}", f"{f:.0%} of peak")
             for d, f in spec.matmul_efficiency]
    rows += [(f"op {k}", f"{fw * 1e6:.1f} us fwd, {bw * 1e6:.1f} us bwd")
             for k, fw, bw in spec.op_overheads]
    for kind, fw, bw, _ in spec.op_rates:
        if kind in GEMM_KINDS:
            rows.append((f"work {kind}", f"{1e-9 / max(fw, 1e-30):.1f} GFLOP/s fwd, "
                                         f"{1e-9 / max(bw, 1e-30):.1f} bwd"))
        else:
            rows.append((f"work {kind}", f"{fw * 1e9:.2f} ns fwd, {bw * 1e9:.2f} ns bwd "
                                         "per element"))
    return rows
