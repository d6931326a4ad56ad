"""Placing stages: the devices an export trace baked into the graph follow the stage."""

from __future__ import annotations

import torch
from torch import nn

from passes.trace import trace
from smp_fx.runtime.planning.placement import _retarget_devices


class Positions(nn.Module):
    """Makes position ids and casts, as Hugging Face models do: export writes the trace's
    device into ``arange`` and the cast."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        return self.emb(pos).to(x.device, torch.float32) + x.unsqueeze(-1)


def _devices(gm: torch.fx.GraphModule) -> set[torch.device]:
    found: set[torch.device] = set()
    for node in gm.graph.nodes:
        torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.add(a)
                                    if isinstance(a, torch.device) else None)
    return found


def test_baked_devices_follow_the_stage_device() -> None:
    gm = trace(Positions(), (torch.zeros(2, 5),), frontend="export")
    assert _devices(gm) == {torch.device("cpu")}
    _retarget_devices(gm, torch.device("cpu"), torch.device("meta"))
    assert _devices(gm) == {torch.device("meta")}
    assert "device(type='meta')" in gm.code
    out = gm.to("meta")(torch.zeros(2, 5, device="meta"))  # runs where the stage is
    assert out.device.type == "meta" and out.shape == (2, 5, 4)


def test_nothing_changes_on_the_trace_device_or_for_meta_weights() -> None:
    gm = trace(Positions(), (torch.zeros(2, 5),), frontend="export")
    code = gm.code
    _retarget_devices(gm, torch.device("cpu"), torch.device("cpu"))
    _retarget_devices(gm, None, torch.device("meta"))
    assert gm.code == code
