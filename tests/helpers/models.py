"""The models tests run: the example models, loaded by path, and small hand-written ones.

``example(name)`` is the one way tests load ``examples/models/<name>.py``: it goes through
``examples.models.load``, i.e. the CLI's ``load_model_file``, so a test exercises the very
module object ``smp-fx partition examples/models/<name>.py`` would build. It is cached per
process: every test (and every rank of a multi-process test) sees one module, whose classes
stay the ones registered in ``sys.modules`` (dataclasses and pickling look them up there).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

import torch
from torch import nn

from examples.models import load

logging.getLogger("transformers").setLevel(logging.ERROR)

EXPECTED_FRONTEND = {"mlp": "fx", "cnn": "fx", "gpt": "fx", "hf_gpt2": "export",
                     "hf_bert": "export"}


@functools.cache
def example(name: str) -> ModuleType:
    """``examples/models/<name>.py``, imported once per process."""
    return load(name)


def build(name: str, batch: int = 2) -> tuple[nn.Module, tuple[Any, ...]]:
    """A fresh example model (seed 0) and its example inputs for ``batch`` samples."""
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
