"""``benchmarks/compile_stages.py``'s check of which chunk graphs torch's stages can run."""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.compile_stages import _unlike_torch
from passes.partition_config import PartitionConfig
from passes.pipeline import compile_model
from passes.split_stages import StagedProgram, split_stages


class _Skip(nn.Module):
    """Three Linears; the first one's output is added again after the third."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h)) + h


def _program(model: nn.Module, stages: int) -> StagedProgram:
    c = compile_model(model, (torch.randn(4, 8),), None, PartitionConfig(num_stages=stages),
                      pins={"a": 0, "b": 1, "c": 2} if stages == 3 else None)
    return split_stages(c.gm, stages)


def test_a_chain_of_chunks_is_torchs_to_run() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    assert _unlike_torch(_program(model, 2)) is None


def test_a_chunk_receiving_from_two_chunks_is_named() -> None:
    reason = _unlike_torch(_program(_Skip(), 3))
    assert reason is not None and "chunk 2 receives from chunks [0, 1]" in reason
