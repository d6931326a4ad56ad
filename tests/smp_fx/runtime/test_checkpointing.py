"""Outlining a stage's regions: same parameters and names, same values, torch checkpoint."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from passes import meta
from passes.checkpoint_regions import Region
from smp_fx.runtime.checkpointing import RegionCall, outline_regions


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = torch.relu(h)  # in the region
        side = h * 2  # outside, between region nodes in graph order, reads the region
        return self.c(self.b(g) + side)


def _outlined() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(_Net())
    plain = torch.fx.GraphModule(gm, gm.graph)
    for n in gm.graph.nodes:
        if n.name in ("a", "relu", "b"):
            meta.CKPT_REGION.set(n, Region("r"))
    nodes = list(gm.graph.nodes)
    mul = next(n for n in nodes if n.name == "mul")
    relu = next(n for n in nodes if n.name == "relu")
    relu.append(mul)  # order: a, relu, mul, b: the outside node sits inside the region
    gm.recompile()
    outline_regions(gm)
    return plain, gm


def test_outlined_regions_keep_names_and_values() -> None:
    plain, gm = _outlined()
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in plain.named_parameters()]
    calls = [n.target for n in gm.graph.nodes if isinstance(n.target, RegionCall)]
    assert [c.name for c in calls] == ["r"]
    x = torch.randn(3, 4, requires_grad=True)
    out = gm(x)
    out.sum().backward()
    got = [p.grad.clone() for p in gm.parameters()] + [x.grad.clone()]
    for p in plain.parameters():
        p.grad = None
    x.grad = None
    want_out = plain(x)
    want_out.sum().backward()
    want = [p.grad for p in plain.parameters()] + [x.grad]
    assert torch.equal(out, want_out)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_region_saves_only_its_inputs() -> None:
    _, gm = _outlined()
    packed: list[torch.Size] = []
    params = {p.data_ptr() for p in gm.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            packed.append(t.shape)
        return t

    x = torch.randn(3, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gm(x)
    # the region's input x, then c's input (the sum); nothing from inside the region
    assert packed == [torch.Size([3, 4]), torch.Size([3, 4])]
