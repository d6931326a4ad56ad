"""A captured graph handed to another model of the same structure: the receiver's own
tensors in it, the sender's graph untouched, what the receiver's own export would give."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from examples.models import hf_zoo
from passes import export_cache, trace_share
from passes.meta import MODULE_PATH
from passes.trace import trace

pytestmark = pytest.mark.skipif(trace_share.available() is not None,
                                reason=str(trace_share.available()))


@pytest.fixture(autouse=True)
def _every_capture_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(export_cache.ENV, "")  # "own" below is this process's export


@pytest.mark.parametrize("arch", ["llama", "t5", "mixtral", "bert"])
def test_the_graph_rebuilt_holds_the_receiver_s_tensors(arch: str) -> None:
    """Also each tensor as the export holds it: BERT's and Llama's non-persistent buffers
    stay out of ``state_dict()``, Llama's lifted constants (its cache's empty tensors)
    stay plain attributes."""
    sender, receiver = hf_zoo.build(arch, seed=0), hf_zoo.build(arch, seed=1)
    x = hf_zoo.inputs(arch, 4)
    gm = trace(sender, x, frontend="export")
    data = trace_share.to_bytes(gm, sender)
    assert all(gm.get_parameter(n) is p for n, p in sender.named_parameters())  # untouched
    assert gm.graph.owning_module is gm
    rebuilt = trace_share.from_bytes(data, receiver)
    assert all(rebuilt.get_parameter(n) is p for n, p in receiver.named_parameters())
    assert all(rebuilt.get_buffer(n) is b for n, b in receiver.named_buffers())
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(*x), receiver(*x), rtol=0, atol=0)
    own = trace(receiver, x, frontend="export")
    assert [(n.op, n.name, str(n.target), MODULE_PATH.get(n)) for n in rebuilt.graph.nodes] \
        == [(n.op, n.name, str(n.target), MODULE_PATH.get(n)) for n in own.graph.nodes]
    assert rebuilt.meta["smp.range_constraints"] == own.meta["smp.range_constraints"]
    assert list(rebuilt.state_dict()) == list(own.state_dict())
    assert [n for n, _ in rebuilt.named_buffers()] == [n for n, _ in own.named_buffers()]
    weights = sum(p.numel() * p.element_size() for p in sender.parameters())
    assert len(data) < weights or weights < 2 ** 20  # the weights do not travel


def test_a_model_of_other_shapes_is_refused() -> None:
    sender = hf_zoo.build("llama")
    gm = trace(sender, hf_zoo.inputs("llama"), frontend="export")
    data = trace_share.to_bytes(gm, sender)
    other = hf_zoo.build("llama")
    with torch.no_grad():
        other.model.model.embed_tokens.weight = nn.Parameter(torch.zeros(3, 64))
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        trace_share.from_bytes(data, other)


def test_the_digest_is_the_structure_and_the_input_shapes() -> None:
    x = hf_zoo.inputs("gpt2", 4)
    one, why = trace_share.digest(hf_zoo.build("gpt2", seed=0), x, {})
    assert one is not None and why == ""
    assert trace_share.digest(hf_zoo.build("gpt2", seed=1), x, {})[0] == one  # weights aside
    assert trace_share.digest(hf_zoo.build("gpt2"), hf_zoo.inputs("gpt2", 2), {})[0] != one
    hooked = hf_zoo.build("gpt2")
    hooked.register_forward_hook(lambda *a: None)
    none, why = trace_share.digest(hooked, x, {})
    assert none is None and "forward_hooks" in why


class _Recorded:
    """An ExportShare that runs the export and records the call."""

    def __init__(self) -> None:
        self.calls = 0

    def run(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            export: Callable[[], torch.fx.GraphModule]) -> torch.fx.GraphModule:
        self.calls += 1
        return export()


def test_trace_runs_only_its_export_through_the_share() -> None:
    share = _Recorded()
    trace(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),), share=share)
    assert share.calls == 0  # fx captured it
    gm = trace(hf_zoo.build("llama"), hf_zoo.inputs("llama"), share=share)
    assert share.calls == 1 and gm.meta["smp.frontend"] == "export"
