"""Outputs of a class torch's pytree does not know (transformers 4.2x's ``ModelOutput``: an
``OrderedDict`` subclass and a dataclass, unregistered) are captured by the export front end
and come back as the model's own class, with the same keys, values and order; registered
types are left as they are."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from passes.model_outputs import RebuiltOutput, has_unknown_outputs, wrap_unknown_outputs
from passes.trace import trace


@dataclasses.dataclass
class Output(OrderedDict):  # type: ignore[type-arg]
    """Like transformers 4.2x's ModelOutput: fields that are None are not keys."""

    loss: Any = None
    logits: Any = None
    hidden: Any = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value


class Plain(OrderedDict):  # type: ignore[type-arg]
    """A mapping that is no dataclass: rebuilt from a dict."""


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        logits = self.body(x)
        loss = None if labels is None else nn.functional.mse_loss(logits, labels)
        return Output(loss=loss, logits=logits)


def test_output_class_is_captured_and_rebuilt() -> None:
    assert Output not in pytree.SUPPORTED_NODES
    model = Head()
    x, y = torch.randn(3, 4), torch.randn(3, 6)
    gm = trace(model, (x,), {"labels": y}, frontend="export")
    got, want = gm(x, labels=y), model(x, labels=y)
    assert type(got) is Output and list(got) == list(want) == ["loss", "logits"]
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)
    assert not model._forward_hooks  # the capture's hook is gone


def test_nested_and_plain_mappings() -> None:
    t = torch.ones(2)
    value = (Output(logits=t), [Plain(a=t, b=Output(hidden=t))], {"k": t})
    assert has_unknown_outputs(value) and not has_unknown_outputs((t, {"k": [t]}))
    leaves, spec = pytree.tree_flatten(wrap_unknown_outputs(value))
    assert len(leaves) == 4 and all(leaf is t for leaf in leaves)
    back = pytree.tree_unflatten(leaves, spec)
    assert type(back[0]) is Output and type(back[1][0]) is Plain
    assert type(back[1][0]["b"]) is Output and list(back[1][0]) == ["a", "b"]
    assert isinstance(wrap_unknown_outputs(Output(logits=t)), RebuiltOutput)
    assert wrap_unknown_outputs({"k": t}) == {"k": t}  # dict is registered: left alone


def test_hugging_face_cache_is_left_out_with_a_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """A Hugging Face model at its default use_cache=True returns a cache object (transformers
    5: ``DynamicCache``): the capture leaves it out, says so, and computes the rest as the
    plain model does."""
    pytest.importorskip("transformers", minversion="5")  # 4.x returns the cache as tuples
    from examples.models import hf_zoo

    plain = hf_zoo.build("gpt2", marked=False).model
    assert plain.config.use_cache
    ids = hf_zoo.inputs("gpt2")[0]
    want = plain(input_ids=ids)
    with caplog.at_level(logging.WARNING, "smp_fx.passes.trace"):
        gm = trace(plain, (), {"input_ids": ids}, frontend="export")
    assert "use_cache=True" in caplog.text and "DynamicCache" in caplog.text
    got = gm(input_ids=ids)
    assert got.past_key_values is None and "past_key_values" not in got
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
