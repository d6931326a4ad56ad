"""``calibrate``: measure this machine into a ``DeviceSpec``, the fits in their order: the
device, the link (two or more processes), then the runtime; every figure's ``sources``
says how it was fitted. See docs/cli.md, 'smp-fx calibrate'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cost_model import calibrate as measure
from cost_model.device import DeviceSpec
from cost_model.microbench import host_overlaps
from cost_model.model_sizes import ModelSizes
from smp_fx.calibration import in_place, runtime_fit
from smp_fx.calibration.runtime_fit import (
    FIT_MICROBATCHES,
    IN_STEP_MICROBATCHES,
    PIPELINED_MICROBATCHES,
)
from smp_fx.world import launch

log = logging.getLogger("smp_fx.calibration")


@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    """What to measure and how long (the ``smp-fx calibrate`` flags, less the output)."""

    name: str | None = None
    """The spec's name; None: ``calibrated-<device type>``."""
    device: str | None = None
    """"cpu" or "cuda"; None: cuda if available."""
    quick: bool = False
    """Fewer sizes and repeats (about a second for the device figures; for tests)."""
    steps: int = 30
    """Timed ``smp.step`` steps per run in the runtime fits (8 when ``quick``)."""
    sizes: ModelSizes | None = None
    """Also measure at a model's sizes (``cost_model.model_sizes``); None: on an
    accelerator the 1.3B GPT's, on the CPU not at all."""

    @property
    def timed_steps(self) -> int:
        return 8 if self.quick else self.steps

    @property
    def repeats(self) -> int:
        """Timed forward and backward passes per size in the in-place fits."""
        return 5 if self.quick else 15


def calibrate(options: CalibrationOptions, world: int) -> DeviceSpec | None:
    """Measure on this process (one of ``world``, torchrun's ``RANK`` / ``LOCAL_RANK``);
    the spec on rank 0, None elsewhere. With ``world`` > 1 it creates the default process
    group (every rank must call it)."""
    device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    name = options.name or f"calibrated-{device.type}"
    if world > 1:
        # one default group for the whole run: each smp.init below only adds its own
        # groups, which state._reset() removes again (re-creating the default group under
        # torchrun would rendezvous on keys the first one left in the store)
        dist.init_process_group(launch.choose_backend())
    spec = from_rank0(lambda: measure.calibrate(name, device, quick=options.quick,
                                                sizes=options.sizes), world)
    if host_overlaps(device):
        log.info("smp-fx calibrate on %s: the in-place and runtime fits are skipped (they fit "
                 "a tiny model's host-bound step, while the host queues a large model's "
                 "kernels as they run); their figures stay estimates", device)
        return _finish(measure.with_link(spec, device, quick=options.quick)
                       if world > 1 else spec)
    spec = dataclasses.replace(spec, microbatch_overhead_s=0.0, step_overhead_s=0.0)
    if world > 1:
        spec = measure.with_link(spec, device, quick=options.quick)
    spec = _in_place(spec, device, options.repeats, world)
    in_step = functools.partial(runtime_fit.fit_in_step, spec, device, options.timed_steps)
    spec = _in_step(spec, from_rank0(in_step, world, everyone=in_step))  # every rank joins
    actions = functools.partial(runtime_fit.fit_actions, spec, device, options.timed_steps)
    per_action, per_step = from_rank0(actions, world, everyone=actions)
    spec = dataclasses.replace(spec, microbatch_overhead_s=per_action, step_overhead_s=per_step)
    how = (f"fitted by smp-fx calibrate: smp.step on one stage (one process's CPU time), "
           f"a tiny model at {' and '.join(map(str, FIT_MICROBATCHES))} microbatches")
    spec = spec.with_sources(microbatch_overhead_s=how, step_overhead_s=how)
    if world > 1:
        fitted = runtime_fit.fit_pipeline(spec, device, options.timed_steps, world)
        if fitted is not None:
            how = (f"fitted by smp-fx calibrate: smp.step at pipeline degree {world} (wall "
                   f"time), a tiny model at {' and '.join(map(str, FIT_MICROBATCHES))} "
                   f"microbatches and the reference transformer at {PIPELINED_MICROBATCHES}, "
                   "jointly (least squares of the relative errors)")
            spec = dataclasses.replace(spec, message_overhead_s=fitted[0],
                                       pipelined_scale=fitted[1]).with_sources(
                message_overhead_s=how, pipelined_scale=how)
    return _finish(spec)


def _finish(spec: DeviceSpec) -> DeviceSpec | None:
    """The spec on rank 0, None elsewhere."""
    return spec if int(os.environ.get("RANK", "0")) == 0 else None


def _in_place(spec: DeviceSpec, device: torch.device, repeats: int, world: int) -> DeviceSpec:
    """``spec`` with the in-place factors fitted (``in_place``), and the convolutions' own
    factor when it prices convolutions; the sources say how."""
    overhead, work = from_rank0(lambda: in_place.fit_scales(spec, device, repeats), world)
    how_scaled = ("fitted by smp-fx calibrate: a two-block transformer's forward and backward "
                  "at three sizes (CPU time of one process) against its predicted fixed "
                  "costs and work, least squares")
    spec = dataclasses.replace(spec, compute_scale=work, overhead_scale=overhead).with_sources(
        compute_scale=how_scaled, overhead_scale=how_scaled)
    if not any(k == "conv" for k, _, _ in spec.op_overheads):
        return spec
    conv = from_rank0(lambda: in_place.fit_conv_scale(spec, device, repeats), world)
    return dataclasses.replace(spec, op_overheads=tuple(
        (k, f * conv, b * conv) if k == "conv" else (k, f, b)
        for k, f, b in spec.op_overheads)).with_sources(
        op_overheads=f"{spec.source('op_overheads')}; conv's then x {conv:.2f}, fitted "
                     "in place on a small ResNet-style stack (its forward and backward "
                     "against the prediction)")


def _in_step(spec: DeviceSpec, scales: tuple[float, float]) -> DeviceSpec:
    """``spec`` with ``fit_in_step``'s factors folded in: the node scale into both in-place
    factors, the optimizer scale into Adam's figures; the sources say so."""
    nodes, adam = scales
    how = (f"; then x {{:.2f}}, fitted by smp-fx calibrate on the reference transformer's "
           f"training step on one stage ({IN_STEP_MICROBATCHES} microbatches, then Adam) "
           "against its prediction")
    spec = dataclasses.replace(
        spec, compute_scale=spec.compute_scale * nodes,
        overhead_scale=spec.overhead_scale * nodes,
        optimizer_tensor_s=spec.optimizer_tensor_s * adam,
        optimizer_byte_s=spec.optimizer_byte_s * adam)
    return spec.with_sources(**{k: spec.source(k) + how.format(nodes)
                                for k in ("compute_scale", "overhead_scale")},
                             **{k: spec.source(k) + how.format(adam)
                                for k in ("optimizer_tensor_s", "optimizer_byte_s")})


def from_rank0(fn: Callable[[], Any], world: int, everyone: Callable[[], Any] | None = None
               ) -> Any:
    """``fn()`` measured by rank 0 alone and sent to every rank: processes measuring at once
    slow each other down, and every rank must plan with the same figures."""
    if world == 1:
        return fn()
    result = [fn() if dist.get_rank() == 0 else (everyone() if everyone else None)]
    dist.broadcast_object_list(result, src=0)
    return result[0]
