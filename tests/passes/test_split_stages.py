"""split_stages: stage modules keep FQNs, values flow forward only, outputs are exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx
from torch import nn

from cost_model.errors import SMPPartitionError
from passes import meta
from passes.split_stages import split_stages
from passes.trace import trace
from tests.helpers.models import example


def _equal_split(gm: torch.fx.GraphModule, k: int) -> torch.fx.GraphModule:
    comp = [n for n in gm.graph.nodes if n.op.startswith("call")]
    for i, n in enumerate(comp):
        meta.STAGE.set(n, i * k // len(comp))
    return gm


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "hf_gpt2"])
def test_example_models_run_exactly(name: str) -> None:
    ex = example(name)
    model = ex.build_model().eval()
    x = ex.example_inputs(4)
    gm = trace(model, x)
    expected = model(*x)
    for k in (2, 4):
        prog = split_stages(_equal_split(gm, k))
        assert prog.num_stages == k
        torch.testing.assert_close(prog.run(*x), expected, atol=0, rtol=0)
        held = {id(p) for st in prog.stages for p in st.module.parameters()}
        assert held == {id(p) for p in model.parameters()}  # every parameter, by identity
        for st in prog.stages:  # the very same Parameter objects as the model's
            for n, p in st.module.named_parameters():
                assert p is model.get_parameter(n)


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        g = self.b(h)
        return {"out": self.c(g) + h, "first": h, "n": x.shape[0]}


def _staged(model: nn.Module, stages: dict[str, int]) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(model)
    for n in gm.graph.nodes:
        if n.op.startswith("call"):
            meta.STAGE.set(n, stages.get(n.name, 0))
    return gm


def test_value_used_by_several_later_stages_is_sent_to_each() -> None:
    gm = _staged(Skip(), {"a": 0, "b": 1, "c": 2, "add": 2, "getattr_1": 0, "getitem": 0})
    before = [(n.name, dict(n.meta)) for n in gm.graph.nodes]
    prog = split_stages(gm)
    assert [(n.name, dict(n.meta)) for n in gm.graph.nodes] == before  # input not mutated
    s0, s1, s2 = prog.stages
    assert dict(s0.sends) == {1: ("a",), 2: ("a", "getitem")}
    assert dict(s2.recvs) == {0: ("a", "getitem"), 1: ("b",)}
    assert s0.program_inputs == ("x",) and s2.program_inputs == ()
    assert [n for n, _ in s1.module.named_parameters()] == ["b.weight", "b.bias"]
    x = torch.randn(3, 4)
    out = prog.run(x)
    ref = gm(x)
    assert set(out) == {"out", "first", "n"} and out["n"] == 3
    torch.testing.assert_close(out["out"], ref["out"], atol=0, rtol=0)


def test_backward_edge_is_a_partition_error() -> None:
    gm = _staged(Skip(), {"a": 1, "b": 0, "c": 1, "add": 1})
    with pytest.raises(SMPPartitionError, match="only send forward"):
        split_stages(gm)


def test_missing_stage_is_a_partition_error() -> None:
    gm = torch.fx.symbolic_trace(Skip())
    with pytest.raises(SMPPartitionError, match="needs a stage"):
        split_stages(gm)


def test_tied_parameter_is_held_by_each_stage_that_reads_it() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids))

    model = Tied()
    gm = _staged(model, {"emb": 0, "head": 1})
    prog = split_stages(copy.copy(gm))
    p0 = dict(prog.stages[0].module.named_parameters())["emb.weight"]
    p1 = dict(prog.stages[1].module.named_parameters())["head.weight"]
    assert p0 is p1 is model.emb.weight
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(prog.run(ids), model(ids), atol=0, rtol=0)


def test_trailing_empty_stage_passes_outputs_through() -> None:
    gm = _staged(nn.Sequential(nn.Linear(2, 2)), {})
    prog = split_stages(gm, num_stages=3)
    assert prog.stages[2].recvs == ((0, ("_0",)),)
    x = torch.randn(1, 2)
    torch.testing.assert_close(prog.run(x), gm(x))
    with pytest.raises(SMPPartitionError, match="past the last stage"):
        split_stages(_staged(nn.Sequential(nn.Linear(2, 2)), {"_0": 2}), num_stages=2)


class StarArgs(nn.Module):
    """``forward(self, *inputs, **options)``: fx makes one placeholder of each."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, *inputs: torch.Tensor, **options: float) -> torch.Tensor:
        h = self.a(inputs[0] * inputs[1])
        return self.b(h) * options["scale"]


def test_star_args_and_kwargs_are_bound_as_the_forward_takes_them() -> None:
    gm = torch.fx.symbolic_trace(StarArgs())
    for n in gm.graph.nodes:
        if n.op.startswith("call"):
            meta.STAGE.set(n, 1 if "b" in n.name or n.name.startswith("mul_1") else 0)
    prog = split_stages(gm)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(prog.run(x, y, scale=2.0), gm(x, y, scale=2.0), atol=0, rtol=0)
