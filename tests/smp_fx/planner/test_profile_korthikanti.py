"""The planner's activation bytes per layer against Korthikanti et al. 2022, section 4.

"Reducing Activation Recomputation in Large Transformer Models" counts, per transformer
layer and tensor-parallel rank, with 2-byte activations and 1-byte dropout masks (s
sequence, b microbatch, h hidden, a heads, t tensor-parallel degree):

- no parallelism: ``sbh (34 + 5as/h)``; tensor parallelism: ``sbh (10 + 24/t + 5as/(ht))``;
  with sequence parallelism: ``sbh/t (34 + 5as/h)``;
- selective recomputation: the ``5as/h`` term goes (``sbh (10 + 24/t)``; with sequence
  parallelism ``sbh 34/t``); full recomputation: the layer's input, ``2sbh`` (``/t``).

smp-fx counts two things more, each a term of its own: the layer norms' float32 mean and
reciprocal deviation (8 bytes a row each, ``16sb`` per layer, ``/t`` when sequence
parallel), which the paper leaves out; and under sequence parallelism the gathered input
of the two column-parallel linears (QKV and the MLP's first), ``2sbh`` each where
Megatron keeps the ``2sbh/t`` chunk and gathers it again in backward: smp-fx's linear
saves the tensor it multiplied, ``4sbh (1 - 1/t)`` more. Priced as Megatron-LM runs
(``runtime="megatron-lm"``) that second term goes: the paper's count and the norms'.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from cost_model.cluster import get_cluster
from smp_fx.planner.layers import KEPT
from smp_fx.planner.model import Profiler, prepare

H, A, S, B, VOCAB = 128, 8, 64, 2, 256


class Layer(nn.Module):
    """Megatron's GPT layer as the paper counts it: pre-norm attention (QKV, scores, softmax,
    dropout, context, projection, dropout) and MLP (4h, GeLU, dropout), residuals."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.p = p
        self.register_buffer("mask", torch.full((S, S), float("-inf")).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (y.view(b, s, A, h // A).transpose(1, 2)
                   for y in self.qkv(self.ln_1(x)).split(h, dim=2))
        scores = q @ k.transpose(-2, -1) / math.sqrt(h // A) + self.mask[:s, :s]
        probs = F.dropout(scores.softmax(-1), self.p, self.training)
        y = (probs @ v).transpose(1, 2).contiguous().view(b, s, h)
        x = x + F.dropout(self.proj(y), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln_2(x)))), self.p, self.training)


class GPT(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, H)
        self.h = nn.ModuleList([Layer() for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(H), nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for layer in self.h:
            x = layer(x)
        return self.head(self.ln_f(x))


def paper(tp: int, sp: bool, recompute: str) -> float:
    """Korthikanti et al.'s bytes per layer and rank (module docstring), over ``sbh``."""
    t, scores = tp, 5 * A * S / H
    if recompute == "full":
        return 2 / t if sp else 2
    if recompute == "selective":
        scores = 0
    return (34 + scores) / t if sp else 10 + 24 / t + scores / t


def smp_fx_terms(tp: int, sp: bool, gathered: bool = True) -> float:
    """What smp-fx counts beyond the paper (module docstring), over ``sbh``; ``gathered``:
    with the gathered sequence smp-fx's linears save (not Megatron-LM's chunk)."""
    stats = 16 * S * B / (S * B * H)
    return stats / tp + 4 * (1 - 1 / tp) * gathered if sp else stats


@pytest.fixture(scope="module", params=["smp-fx", "megatron-lm"])
def profiler(request: pytest.FixtureRequest) -> Profiler:
    with torch.device("meta"):
        model = GPT().to(torch.bfloat16).train()
    return Profiler(prepare(model, lambda n: (torch.randint(0, VOCAB, (n, S)),)),
                    get_cluster("dgx-h100"), runtime=request.param)


@pytest.mark.parametrize("tp, sp", [(1, False), (8, False), (8, True)])
def test_bytes_per_layer_are_the_papers(profiler: Profiler, tp: int, sp: bool) -> None:
    layer = profiler(B, tp, sp).parts[KEPT]
    sbh = S * B * H
    gathered = profiler.runtime != "megatron-lm"
    for recompute in ("none", "selective", "full"):
        kept = layer.kept(recompute)[0]
        extra = smp_fx_terms(tp, sp, gathered) if recompute != "full" else 0.0
        assert kept == pytest.approx(sbh * (paper(tp, sp, recompute) + extra), abs=0.5), \
            (recompute, kept / sbh, paper(tp, sp, recompute), extra)
