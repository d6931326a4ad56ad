"""The reference model ``smp-fx calibrate`` fits ``DeviceSpec.compute_scale`` on.

Why: the device figures are microbenchmarks, each op timed alone in a loop with its data
hot in cache. Inside a real forward and backward the same ops run slower (colder caches,
the allocator, autograd's graph): on the 2-core CPU this project is developed on, every
example model's training step came out at 0.59-0.70 of the measured one with the
microbenchmarked figures alone, and each op timed in place in the model took 1.1-1.5x its
microbenchmarked time. One factor, fitted on a small transformer (embedding, layer norms,
attention by matmul and softmax, a GELU MLP, an LM head), closes most of that gap without
touching the per-op figures, which keep their shape across sizes.

``fit_compute_scale(spec, device)`` = the median CPU time of this model's forward and
backward / the sum of its nodes' analytic times under ``spec`` (scale 1).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
from torch import nn
from torch.nn import functional as F

from cost_model import microbench
from cost_model.device import DeviceSpec
from cost_model.errors import SMPError

VOCAB, WIDTH, HEADS, LAYERS, BATCH, SEQ = 512, 128, 4, 2, 8, 32


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(WIDTH, dim=2)
        q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) * (c // HEADS) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class Reference(nn.Module):
    """A two-block transformer LM, about 0.5 M parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*[_Block() for _ in range(LAYERS)])
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.blocks(self.embed(tokens))))


def fit_compute_scale(spec: DeviceSpec, device: torch.device, repeats: int = 15) -> float:
    """Measured / predicted time of the reference model's forward and backward."""
    from passes import meta
    from passes.pipeline import analyse

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Reference().to(device)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
        grad = torch.randn(BATCH, SEQ, VOCAB, device=device)
    costed = analyse(model, (tokens,), device=dataclasses.replace(spec, compute_scale=1.0))
    predicted = sum(c.fwd_time_s + c.bwd_time_s for n in costed.graph.nodes
                    if (c := meta.COST.get(n)) is not None)
    now = microbench.clock(device)

    def once() -> float:
        model.zero_grad(set_to_none=True)
        t0 = now()
        model(tokens).backward(grad)
        return now() - t0

    for _ in range(3):
        once()
    measured = statistics.median(once() for _ in range(repeats))
    if not predicted > 0:
        raise SMPError.build("the reference model's predicted time must be > 0", predicted,
                             "smp-fx calibrate (compute scale)",
                             "check the spec's op figures (all zero?)")
    return measured / predicted


__all__ = ["Reference", "fit_compute_scale"]
