"""Repeated layers found in a traced graph; two kept."""

from __future__ import annotations

import torch
from torch import nn

from examples.models import mlp
from passes import meta
from passes.shape_prop import shape_prop
from passes.trace import trace
from smp_fx.planner.layers import find_repeats, keep_layers, layer_of
from tests.smp_fx.planner.conftest import gpt_inputs, tiny_gpt


def _layers(gm: torch.fx.GraphModule) -> set[str]:
    out = set()
    for n in gm.graph.nodes:
        key = layer_of(meta.MODULE_PATH.get(n, "") or "")
        if key is not None:
            out.add(f"{key[0]}.{key[1]}")
    return out


def test_gpt_layers_found_and_two_kept() -> None:
    gm = trace(tiny_gpt(6), gpt_inputs(1))
    rep = find_repeats(gm)
    assert rep is not None and (rep.parent, rep.count) == ("h", 6)
    small = keep_layers(gm, rep)
    assert _layers(small) == {"h.0", "h.1"}
    assert _layers(gm) == {f"h.{i}" for i in range(6)}  # the input is not modified
    # the reduced graph still runs, on the shapes of the model's own
    out = shape_prop(small, gpt_inputs(2))
    last = next(n for n in out.graph.nodes if n.op == "output").all_input_nodes[0]
    assert meta.TENSOR.get(last).shape == (2, 16, 64)
    # only the kept layers' weights remain
    names = {n for n, _ in small.named_parameters()}
    assert any(n.startswith("h.1.") for n in names)
    assert not any(n.startswith("h.2.") for n in names)


def test_no_repeats_in_a_chain_of_different_modules() -> None:
    assert find_repeats(trace(mlp.build_model(), mlp.example_inputs(2))) is None


def test_layers_that_differ_are_not_repeats() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 16)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.h:
                x = layer(x)
            return x

    assert find_repeats(trace(Odd(), (torch.randn(2, 8),))) is None


def test_an_inner_layer_read_after_the_layers_is_not_a_chain() -> None:
    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            outs = []
            for layer in self.h:
                x = layer(x)
                outs.append(x)
            return x + outs[1]

    assert find_repeats(trace(Skip(), (torch.randn(2, 8),))) is None


def test_layer_of() -> None:
    assert layer_of("h.3.attn") == ("h", 3)
    assert layer_of("layer1.conv") is None
    assert layer_of("0.weight") == ("", 0)
