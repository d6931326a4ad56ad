"""``smp.nn.DistributedEmbedding``: an nn.Embedding at tp=1, split by vocabulary rows by the
tensor-parallel rewrite, SMP's private output-split options refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import smp_fx as smp
from passes.partition_config import PartitionConfig
from passes.pipeline import compile_model
from passes.tensor_parallel import TensorParallelism
from smp_fx.marking.tensor_parallelism import is_marked, marked_paths


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = smp.nn.DistributedEmbedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_it_is_a_marked_embedding_with_smps_initialisation() -> None:
    torch.manual_seed(0)
    emb = smp.nn.DistributedEmbedding(100, 32, padding_idx=3, initializer_range=0.5)
    assert isinstance(emb, nn.Embedding) and is_marked(emb)
    assert emb.weight[3].abs().sum() == 0
    assert 0.4 < emb.weight.std().item() < 0.6
    ids = torch.tensor([[1, 3, 99]])
    torch.testing.assert_close(emb(ids), nn.functional.embedding(ids, emb.weight, 3))


def test_the_rewrite_splits_it_by_vocabulary_rows() -> None:
    torch.manual_seed(0)
    model = LM()
    compiled = compile_model(model, (torch.randint(0, 16, (2, 5)),), None,
                             PartitionConfig(num_stages=1),
                             tp=TensorParallelism(2, 1, True, marked_paths(model)))
    [spec] = compiled.tp_plan.sharded
    assert (spec.name, spec.dim, spec.parts, spec.full_shape) == ("embed.weight", 0, 2, (16, 8))
    shard = dict(compiled.gm.named_parameters())["embed.weight"]
    torch.testing.assert_close(shard, model.embed.weight[8:].detach())


def test_an_output_left_split_is_not_built() -> None:
    with pytest.raises(smp.SMPNotImplementedError, match="_skip_allgather"):
        smp.nn.DistributedEmbedding(16, 8, _skip_allgather=True)
