"""The MLP example, partitioned by hand with ``smp.partition`` contexts (SMP's manual mode).

Modules *created* inside ``with smp.partition(i):`` belong to partition ``i``; the rest go
to ``default_partition``. Use it with ``auto_partition: false``, e.g.::

    smp-fx partition examples/models/mlp_manual.py --partitions 2 --no-auto-partition \\
        --default-partition 1

gives stage 0 = ``blocks.0``-``blocks.2``, stage 1 = ``blocks.3``, ``blocks.4`` and ``head``.
"""

from __future__ import annotations

import torch
from torch import nn

import smp_fx as smp

IN_FEATURES = 32
HIDDEN = 64
NUM_CLASSES = 10


class ManualMLP(nn.Module):
    def __init__(self, in_features: int = IN_FEATURES, hidden: int = HIDDEN,
                 num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        with smp.partition(0):
            blocks.append(nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU()))
            blocks += [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(2)]
        # created outside any context: default_partition
        blocks += [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(2)]
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build_model() -> nn.Module:
    return ManualMLP()


def example_inputs(batch_size: int = 4) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, IN_FEATURES),)


def example_targets(batch_size: int = 4) -> torch.Tensor:
    return torch.randint(0, NUM_CLASSES, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
