"""A tiny ResNet-style CNN with skip connections: a DAG (not a chain) for the partitioner."""

from __future__ import annotations

import torch
from torch import nn

NUM_CLASSES = 10
IMAGE_SIZE = 16


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus an identity (or 1x1 projection) shortcut, then relu."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self, width: int = 8, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.layer3 = BasicBlock(2 * width, 4 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model(width: int = 8, num_classes: int = NUM_CLASSES) -> nn.Module:
    return TinyResNet(width, num_classes)


def example_inputs(batch_size: int = 4) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE),)


def example_targets(batch_size: int = 4) -> torch.Tensor:
    return torch.randint(0, NUM_CLASSES, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
