"""The models the calibration fits run, and the sizes they run at: fixed, so a fitted factor
is comparable between machines and runs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, HEADS, LAYERS, BATCH, SEQ = 512, 128, 4, 2, 8, 32

SIZES = ((1, 8), (2, 16), (BATCH, SEQ))
"""(batch, tokens) the in-place scales are fitted over: small sizes expose the fixed costs."""

CONV_INPUT = (8, 3, 16, 16)
"""``ConvReference``'s input (batch, channels, height, width)."""

TINY_BATCH = 16
"""``tiny``'s samples per step: two per microbatch at 8 microbatches."""


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


class ConvReference(nn.Module):
    """A small ResNet-style stack at CIFAR-like sizes: what ``fit_conv_scale`` times."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for cin, cout, stride in ((3, 16, 1), (16, 16, 1), (16, 32, 2), (32, 32, 1)):
            layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Conv2d(32, 64, 1, 2, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def tiny(stages: int) -> nn.Module:
    """An MLP of two 16-wide blocks per stage and a 4-class head: next to no compute."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU())
                           for _ in range(2 * stages)], nn.Linear(16, 4))
