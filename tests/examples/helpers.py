"""Shared helpers for the front-end tests: load example models, small untraceable modules."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.models import load  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

EXPECTED_FRONTEND = {"mlp": "fx", "cnn": "fx", "gpt": "fx", "hf_gpt2": "export",
                     "hf_bert": "export"}


@functools.cache
def example(name: str) -> ModuleType:
    return load(name)


def build(name: str, batch: int = 2) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    ex = example(name)
    return ex.build_model(), ex.example_inputs(batch)


class DataDependent(nn.Module):
    """Branches on a tensor *value*: neither fx nor export can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)


class WithUntraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.odd = DataDependent()
        self.post = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.relu(self.odd(self.pre(x))))


def state_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (tied ones once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in (*model.parameters(), *model.buffers()):
        seen[id(t)] = t
    return sum(t.numel() * t.element_size() for t in seen.values())
