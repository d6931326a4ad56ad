"""How much slower ops run inside a model than alone: ``DeviceSpec.overhead_scale`` and
``DeviceSpec.compute_scale``, then the convolutions' own factor.

Fixed costs grow about 2.3x in place while work does not, so one factor cannot fit: two
are fitted by least squares over the reference model at several sizes
(docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
from torch import nn

from cost_model import microbench
from cost_model.device import DeviceSpec
from cost_model.errors import SMPError
from passes import meta
from passes.pipeline import analyse
from passes.trace import trace
from smp_fx.calibration.reference import CONV_INPUT, SIZES, VOCAB, ConvReference, Reference
from smp_fx.calibration.solve import clamp, least_squares

LIMITS = (0.25, 8.0)
"""Each in-place factor is clamped to these: a fit beyond them is a broken measurement."""


def fit_scales(spec: DeviceSpec, device: torch.device, repeats: int = 15
               ) -> tuple[float, float]:
    """(overhead_scale, compute_scale): least squares of the reference model's measured
    forward and backward (CPU time, median of ``repeats``) over ``SIZES`` against its
    predicted fixed costs and work (module docstring), each clamped to ``LIMITS``."""
    rows = [_size_row(spec, device, batch, tokens, repeats) for batch, tokens in SIZES]
    solved = least_squares(rows)
    if solved is None:
        raise SMPError.build("the reference model's predicted fixed costs and work must "
                             "not be proportional", rows, "smp-fx calibrate (scales)",
                             "check the spec's op figures (all zero?)")
    fixed, work = solved
    return clamp(fixed, LIMITS), clamp(work, LIMITS)


def fit_conv_scale(spec: DeviceSpec, device: torch.device, repeats: int = 15) -> float:
    """The convolutions' fixed-cost factor beyond ``overhead_scale`` that makes
    ``ConvReference``'s prediction equal its measurement (clamped; 1.0 without
    convolutions): a library's per-call setup grows less in place than dispatch does."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ConvReference().to(device)
        x = torch.randn(*CONV_INPUT, device=device)
        grad = torch.randn_like(model(x))
    traced = trace(model, (x,), {})

    def predicted(conv: float) -> float:
        ops = tuple((k, f * conv, b * conv) if k == "conv" else (k, f, b)
                    for k, f, b in spec.op_overheads)
        return _predicted(model, x, traced, dataclasses.replace(spec, op_overheads=ops))

    rest = predicted(0.0)
    conv = predicted(1.0) - rest
    if not conv > 0:
        return 1.0
    measured = _measured(model, x, grad, device, repeats)
    return clamp((measured - rest) / conv, LIMITS)


def _size_row(spec: DeviceSpec, device: torch.device, batch: int, tokens: int,
              repeats: int) -> tuple[float, float, float]:
    """(predicted fixed s, predicted work s, measured s) of one forward and backward."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Reference().to(device)
        ids = torch.randint(0, VOCAB, (batch, tokens), device=device)
        grad = torch.randn(batch, tokens, VOCAB, device=device)

    traced = trace(model, (ids,), {})

    def predicted(overhead_scale: float) -> float:
        return _predicted(model, ids, traced, dataclasses.replace(
            spec, compute_scale=1.0, overhead_scale=overhead_scale))

    both = predicted(1.0)
    fixed = predicted(2.0) - both
    return fixed, both - fixed, _measured(model, ids, grad, device, repeats)


def _predicted(model: nn.Module, x: torch.Tensor, traced: torch.fx.GraphModule,
               spec: DeviceSpec) -> float:
    """The predicted forward and backward of ``model`` on ``x`` (its trace) under ``spec``."""
    costed = analyse(model, (x,), traced=traced, device=spec)
    return sum(c.fwd_time_s + c.bwd_time_s for n in costed.graph.nodes
               if (c := meta.COST.get(n)) is not None)


def _measured(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, device: torch.device,
              repeats: int) -> float:
    """Median seconds of one forward and backward (the device's clock), after 3 warm-ups."""
    now = microbench.clock(device)

    def once() -> float:
        model.zero_grad(set_to_none=True)
        t0 = now()
        model(x).backward(grad)
        return now() - t0

    for _ in range(3):
        once()
    return statistics.median(once() for _ in range(repeats))
