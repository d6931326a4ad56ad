"""assign_manual: innermost pinned module wins, glue follows data, errors name the place."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from cost_model.errors import SMPPartitionError
from passes import meta
from passes.assign_manual import assign_manual
from passes.auto_partition import evaluate_stages
from passes.partition_config import PartitionConfig
from smp_fx.marking.manual import partition, pins_by_module_path
from tests.passes.partitioning.graphs import annotate, tiny_gpt


def stages(gm: torch.fx.GraphModule) -> dict[str, int]:
    return {n.name: meta.STAGE.get(n) for n in gm.graph.nodes}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        with partition(1):
            self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            with partition(2):
                self.tail = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.pre(x)) * 2.0  # root-level glue between stages 1 and 2
        return self.tail(h)


def test_contexts_to_stages() -> None:
    model = Net()
    gm = annotate(model, torch.zeros(2, 4))
    before = [dict(n.meta) for n in gm.graph.nodes]
    out = assign_manual(gm, pins_by_module_path(model), default_partition=0, num_stages=3)
    assert [dict(n.meta) for n in gm.graph.nodes] == before
    st = stages(out)
    assert st["pre"] == 0 and st["body_0"] == 1 and st["body_1"] == 1 and st["tail"] == 2
    assert st["mul"] == 1, "glue follows its input"
    assert st["x"] == 0 and st["output"] == 2
    assert meta.PIN.get(next(n for n in out.graph.nodes if n.name == "body_0")) == 1
    result = evaluate_stages(out, PartitionConfig(num_stages=3, auto_partition=False))
    assert [len(s.nodes) for s in result.stages] == [1, 3, 1]


def test_unpinned_go_to_default_partition() -> None:
    gm = tiny_gpt(2)
    out = assign_manual(gm, {"blocks.1": 1}, default_partition=1, num_stages=2)
    st = stages(out)
    assert st["emb"] == 1 and st["blocks_0_fc1"] == 1 and st["blocks_1_fc2"] == 1


def test_index_too_large_names_the_module() -> None:
    with pytest.raises(SMPPartitionError, match="module 'blocks.1'"):
        assign_manual(tiny_gpt(2), {"blocks.1": 2}, default_partition=0, num_stages=2)
    with pytest.raises(SMPPartitionError, match="default_partition"):
        assign_manual(tiny_gpt(2), {}, default_partition=3, num_stages=2)


def test_cyclic_pins_are_rejected_with_the_edge() -> None:
    # blocks.0 runs before blocks.1 but is pinned later: a value would flow backwards
    with pytest.raises(SMPPartitionError, match=r"stage 1\) -> .*stage 0\)"):
        assign_manual(tiny_gpt(2), {"blocks.0": 1, "blocks.1": 0}, default_partition=0,
                      num_stages=2)
