"""``DistributedModel.module``: SMP v1's wrapper chain above the wrapped module, as AWS's
1.x scripts walk it (``model.module.module.transformer...``), and what 1.11+'s
``sharded_data_parallel_checkpoint.py`` reads through it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.module_view import ModuleView
from tests.helpers.numerics import init


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.register_buffer("kept", torch.ones(2))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer.h(x) * self.kept[0]


def _buffer_names(module: Any, prefix: str = "") -> list[str]:
    """What 1.11+'s sharded_data_parallel_checkpoint.get_buffer_names walks."""
    names = [prefix + n for n, b in module.named_buffers(recurse=False)
             if b is not None and n not in module._non_persistent_buffers_set]
    for n, child in module.named_children():
        names += _buffer_names(child, prefix + n + ".")
    return names


@pytest.mark.parametrize("fp16", [False, True])
def test_the_scripts_walk_reaches_the_module(one_thread: None, fp16: bool) -> None:
    init(1, 1, "simple", **({"fp16": True} if fp16 else {}))
    net = _Net()
    model = smp.DistributedModel(net)
    m = model.module if fp16 else model  # AWS's GPT-J / GPT-Neo 1.x scripts
    assert m.module.module is net and m.module.module.transformer.h is net.transformer.h
    assert model.get_module() is net
    chain = model.module
    assert isinstance(chain, ModuleView) and (chain.module.module is net if fp16 else
                                              chain.module is net)
    # everything else is the module's: names without a prefix, calls, assignment
    assert [n for n, _ in model.module.named_parameters()] == [
        n for n, _ in net.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert _buffer_names(model.module) == ["kept"]
    x = torch.randn(2, 4, dtype=torch.float16 if fp16 else torch.float32)
    torch.testing.assert_close(model.module(x), net(x))
    model.module.flag = 3
    assert net.flag == 3 and model.module.transformer.h[1] is net.transformer.h[1]
    # the module is registered once (no second copy in the tree); walks by name see the
    # model standing in for its root, under the module's own names
    assert dict(model._modules) == {"module": net}
    assert [(n, id(m)) for n, m in model.named_modules()][1:] == [
        (n, id(m)) for n, m in net.named_modules()][1:]


def test_a_wrapper_the_script_made_stays_below(one_thread: None) -> None:
    """GPT-Neo's fp16 path wraps the model in its own FP16_Module before smp-fx sees it:
    ``model.module.module.module`` is then the model, as in SMP."""
    init(1, 1, "simple")

    class OwnFP16(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    net = _Net()
    model = smp.DistributedModel(OwnFP16(net))
    assert model.module.module.module.transformer is net.transformer
