"""The figures that decide a large model, measured at its sizes.

A calibration on small operands leaves a large model's kernels to extrapolation; on an
accelerator the step is its kernels' time, so ``at_model_sizes`` measures them where the
model runs them: matmul efficiency by smallest dimension in the model's dtype, causal
attention at its head shape, element-wise bandwidth by size, Adam on parameter-sized
tensors. Device-generic: the tests run it on the CPU at tiny sizes. See docs/cli.md,
'smp-fx calibrate'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from cost_model.device import DeviceSpec
from cost_model.errors import SMPConfigError
from cost_model.flops import sdpa_flops
from cost_model.microbench import (
    Budget,
    host_overlaps,
    matmul_table,
    measure_elementwise,
    measure_optimizer,
    timer,
)


@dataclass(frozen=True)
class ModelSizes:
    """Where to measure: the attention's head shape, the matmul sizes, the model's dtype.

    The defaults are the 1.3B GPT of docs/planning.md, 'On a GPU'."""

    heads: int = 16
    seq: int = 1024
    head_dim: int = 128
    dtype: str = "bfloat16"
    matmul_dims: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    elementwise_bytes: tuple[int, ...] = (3 * 2**12, 3 * 2**16, 3 * 2**20, 3 * 2**24,
                                          3 * 2**28)
    adam_sizes: tuple[tuple[int, int], tuple[int, int]] = ((256, 1024), (8, 2**24))

    @classmethod
    def parse(cls, text: str, **sizes: object) -> ModelSizes:
        """``HEADSxSEQxHEAD_DIM`` (the ``--attention`` flag) and any other field."""
        try:
            heads, seq, head_dim = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise SMPConfigError.build(
                "--attention is HEADSxSEQxHEAD_DIM", text, "smp-fx calibrate",
                "e.g. --attention 16x1024x128 (the heads, sequence length and head "
                "dimension of the model to plan)") from None
        return cls(heads=heads, seq=seq, head_dim=head_dim, **sizes)  # type: ignore[arg-type]


TINY = ModelSizes(heads=2, seq=16, head_dim=8, dtype="float32", matmul_dims=(4, 16, 32),
                  elementwise_bytes=(3 * 2**10, 3 * 2**16), adam_sizes=((8, 16), (2, 2**12)))
"""Sizes a CPU measures in a second: for the tests and ``--tiny`` runs."""


def attention_rate(budget: Budget, device: torch.device, sizes: ModelSizes
                   ) -> tuple[str, float, float, float]:
    """The causal fused attention's (kind, forward s, backward s per FLOP, reference size)
    at the model's head shape; FLOPs counted as ``sdpa_flops`` counts them (the full square:
    the rate absorbs the causal kernel's skipped half)."""
    dtype = getattr(torch, sizes.dtype)
    shape = (2, sizes.heads, sizes.seq, sizes.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)
    flops = sdpa_flops(shape, shape, shape)
    timed = timer(budget, device)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # the backward timed alone: a difference of two noisy timings reads 0 on a loaded host
    bwd = timed(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    return "sdpa", fwd / flops, bwd / (2 * flops), float(min(sizes.seq, sizes.head_dim))


def at_model_sizes(spec: DeviceSpec, device: torch.device, sizes: ModelSizes,
                   budget: Budget) -> DeviceSpec:
    """``spec`` with the figures of a model of ``sizes`` measured on ``device`` (module
    doc); ``budget`` gives the repeats. Where the host overlaps the kernels
    (``host_overlaps``) the per-op fixed costs become zero and every kind but attention is
    priced by the roofline: a large model's step is then its kernels' time."""
    timed = timer(budget, device)
    dtype = getattr(torch, sizes.dtype)
    big = max(sizes.matmul_dims)
    peak, table = matmul_table(timed, device, sizes.matmul_dims, big, dtype)
    sdpa = attention_rate(budget, device, sizes)
    bandwidth, ew = measure_elementwise(
        dataclasses.replace(budget, elementwise_bytes=sizes.elementwise_bytes), device)
    per_tensor, per_byte = measure_optimizer(
        dataclasses.replace(budget, adam_sizes=sizes.adam_sizes), device)
    peak_field = "peak_flops_fp32" if dtype == torch.float32 else "peak_flops_bf16"
    how = (f"measured by cost_model.model_sizes on {device.type} at a model's sizes "
           f"({sizes.dtype}, matmuls up to {big}, attention {sizes.heads} x {sizes.seq} x "
           f"{sizes.head_dim})")
    spec = dataclasses.replace(spec, mem_bandwidth=bandwidth, elementwise_efficiency=ew,
                               matmul_efficiency=table, matmul_shapes=f"linear:{big}",
                               optimizer_tensor_s=per_tensor, optimizer_byte_s=per_byte)
    if dtype == torch.float32:
        spec = dataclasses.replace(spec, peak_flops_fp32=peak)
    else:
        spec = dataclasses.replace(spec, peak_flops_bf16=peak)
    notes = {k: how for k in ("mem_bandwidth", "elementwise_efficiency", "optimizer_tensor_s",
                              "optimizer_byte_s", peak_field)}
    notes["matmul_efficiency"] = f"{how}, relative to the {sizes.dtype} peak"
    if host_overlaps(device):
        host = spec.op_overhead("default")
        spec = dataclasses.replace(spec, op_overheads=(), op_rates=(sdpa,))
        notes["op_overheads"] = (f"zero: the host queues ops while the kernels run (measured "
                                 f"host cost {host[0] * 1e6:.1f} us per op forward, "
                                 f"{host[1] * 1e6:.1f} us backward)")
        notes["op_rates"] = f"{how}: causal sdpa only; other kinds by the roofline"
    else:
        spec = dataclasses.replace(spec, op_rates=tuple(
            r for r in spec.op_rates if r[0] != "sdpa") + (sdpa,))
        notes["op_rates"] = f"{spec.source('op_rates')}; sdpa (causal) {how}"
    return spec.with_sources(**notes)
