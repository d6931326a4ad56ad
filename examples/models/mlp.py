"""A deep-ish MLP: 8 Linear+ReLU blocks in ``nn.Sequential``; the simplest chain to partition."""

from __future__ import annotations

import torch
from torch import nn

IN_FEATURES = 32
HIDDEN = 64
NUM_CLASSES = 10
NUM_BLOCKS = 8


def build_model(in_features: int = IN_FEATURES, hidden: int = HIDDEN,
                num_classes: int = NUM_CLASSES, num_blocks: int = NUM_BLOCKS) -> nn.Module:
    """A chain of ``num_blocks`` Linear+ReLU blocks followed by a classifier head."""
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(num_blocks):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def example_inputs(batch_size: int = 4) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, IN_FEATURES),)


def example_targets(batch_size: int = 4) -> torch.Tensor:
    return torch.randint(0, NUM_CLASSES, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
