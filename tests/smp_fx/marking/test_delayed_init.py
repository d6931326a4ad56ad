from __future__ import annotations

import pytest
import torch
from torch import nn

import smp_fx
from smp_fx.marking.delayed_init import delay_param_initialization, is_delayed, materialize
from tests.helpers.models import example


def test_meta_construction_marks_modules() -> None:
    with smp_fx.delay_param_initialization():
        model = example("gpt").build_model()
    assert all(p.is_meta for p in model.parameters())
    assert getattr(model, "_smp_delayed_init", False) and is_delayed(model)
    assert model.lm_head.weight is model.wte.weight
    assert not torch.empty(1).is_meta  # the context is gone afterwards
    with delay_param_initialization(enabled=False):
        plain = nn.Linear(2, 2)
    assert not plain.weight.is_meta and not is_delayed(plain)


def test_materialize_keeps_ties_and_runs() -> None:
    with delay_param_initialization():
        model = example("gpt").build_model()
    materialize(model, "cpu")
    assert not is_delayed(model)
    assert model.lm_head.weight is model.wte.weight and not model.wte.weight.is_meta
    out = model(*example("gpt").example_inputs(2))
    assert torch.isfinite(out).all()


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


def test_materialize_refuses_uninitialisable_modules() -> None:
    with delay_param_initialization():
        model = _NoReset()
    with pytest.raises(smp_fx.SMPRuntimeError, match="reset_parameters"):
        materialize(model, "cpu")
