"""Causal attention timed on a GPU by key length, against the rates the Hopper specs price.

Why: the planner prices Megatron-Core's attention on Hopper at the cuDNN and
FlashAttention-2 rates FlashAttention-3's paper publishes
(``cost_model.gpu_specs.HOPPER_TE_ATTENTION``, ``HOPPER_FLASH2_ATTENTION``: kernel
figures from short runs). This times PyTorch's ``scaled_dot_product_attention`` with each
backend it has there (cuDNN, flash) at head dimension 128, bf16, causal, 16K tokens a
call, forward and backward (each timed alone), and prints each rate (FLOPs counted
full-square, as ``cost_model.flops`` counts them) beside the priced one.

    PYTHONPATH=. python3 benchmarks/attention_rates.py --out $OUT/attention.json   # a GPU
    PYTHONPATH=. .venv/bin/python benchmarks/attention_rates.py --tiny             # CPU

``--tiny``: two short lengths, 256 tokens, the math backend on the CPU: it checks the script.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gemm_shapes import time_call  # noqa: E402  (one timing rule for both scripts)

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
HEADS, HEAD_DIM = 16, 128


def full_square_flops(batch: int, heads: int, length: int, dim: int) -> float:
    """A forward's FLOPs counted on the whole score square (QK^T and PV), as
    ``cost_model.flops`` counts sdpa; its backward is priced as twice this."""
    return 4.0 * batch * heads * length * length * dim


def _backends() -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "math": SDPBackend.MATH}


def time_length(length: int, backend: str, dtype: torch.dtype, device: torch.device,
                calls: int, repeats: int, tokens: int = TOKENS) -> dict[str, Any]:
    """Forward and backward of one causal attention call of ``tokens`` tokens (whole
    sequences of ``length``), each timed alone, as ``cost_model.model_sizes.attention_rate``
    times them: the difference of two noisy timings can read 0 or less on a loaded host."""
    from torch.nn.attention import sdpa_kernel

    batch = max(1, tokens // length)
    q, k, v = (torch.randn(batch, HEADS, length, HEAD_DIM, dtype=dtype, device=device,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, HEADS, length, HEAD_DIM, dtype=dtype, device=device)
    kind = _backends()[backend]

    def fwd() -> torch.Tensor:
        with sdpa_kernel(kind), torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with sdpa_kernel(kind):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    timed: dict[str, Callable[[], Any]] = {
        "forward": fwd,
        "backward": lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)}
    f, b = (time_call(fn, calls, repeats, device) for fn in timed.values())
    flops = full_square_flops(batch, HEADS, length, HEAD_DIM)
    return {"length": length, "backend": backend, "batch": batch, "forward_s": f,
            "backward_s": b, "forward_flops_per_s": flops / f,
            "backward_flops_per_s": 2 * flops / b}


def priced(length: int) -> dict[str, tuple[float, float]]:
    """The (forward, backward) rates the Hopper specs price at ``length`` and ``HEAD_DIM``."""
    from cost_model.gpu_specs import SOURCED_GPUS, with_attention

    out = {}
    for name, backend in (("cudnn", "cudnn"), ("flash", "flash2")):
        rate = with_attention(SOURCED_GPUS["h100-sxm"], backend).attention_rate(length, HEAD_DIM)
        assert rate is not None
        out[name] = rate
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    lengths, backends = (LENGTHS, ("cudnn", "flash")) if gpu else ((64, 128), ("math",))
    rows = []
    print(f"{'backend':<7} {'length':>6} {'fwd TFLOP/s':>11} {'priced':>7} "
          f"{'bwd TFLOP/s':>11} {'priced':>7}  (full-square FLOPs)", flush=True)
    for backend in backends:
        for length in lengths:
            try:
                r = time_length(length, backend, dtype, device, args.calls, args.repeats,
                                TOKENS if gpu else 256)
            except RuntimeError as exc:  # a backend this build or GPU lacks
                print(f"{backend:<7} {length:>6} not run: {str(exc).splitlines()[0]}",
                      flush=True)
                continue
            pf, pb = priced(length).get(backend, (float("nan"), float("nan")))
            r["priced_forward_flops_per_s"], r["priced_backward_flops_per_s"] = pf, pb
            rows.append(r)
            print(f"{backend:<7} {length:>6} {r['forward_flops_per_s'] / 1e12:>11.1f} "
                  f"{pf / 1e12:>7.1f} {r['backward_flops_per_s'] / 1e12:>11.1f} "
                  f"{pb / 1e12:>7.1f}", flush=True)
    figures = {"device": torch.cuda.get_device_name(device) if gpu else "cpu",
               "torch": torch.__version__, "dtype": str(dtype).split(".")[-1],
               "heads": HEADS, "head_dim": HEAD_DIM, "tokens": TOKENS, "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return figures


if __name__ == "__main__":
    main()
