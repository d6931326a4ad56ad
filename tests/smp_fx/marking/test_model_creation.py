"""``smp.model_creation``: SMP's signature, tensor-parallel marking, the creation dtype,
delayed initialisation from the configuration, and its keywords checked."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.marking.tensor_parallelism import is_marked
from smp_fx.world import state
from tests.helpers.numerics import init


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    yield
    smp.reset()
    state._reset()


def test_signature_is_smps() -> None:
    params = inspect.signature(smp.model_creation).parameters
    assert list(params)[:2] == ["tensor_parallelism", "dtype"]
    assert params["tensor_parallelism"].default is False and params["dtype"].default is None
    assert params["tensor_parallel_config"].kind is inspect.Parameter.VAR_KEYWORD


def test_marks_dtype_and_restores_the_default() -> None:
    before = torch.get_default_dtype()
    with smp.model_creation(tensor_parallelism=True, dtype=torch.float64):
        on = nn.Linear(2, 2)
        with smp.model_creation(tensor_parallelism=False):
            off = nn.Linear(2, 2)  # the innermost context wins, as SMP's
    assert is_marked(on) and not is_marked(off)
    assert on.weight.dtype == torch.float64 and off.weight.dtype == torch.float64
    assert torch.get_default_dtype() == before
    with smp.model_creation():
        plain = nn.Linear(2, 2)
    assert not is_marked(plain) and plain.weight.dtype == before


def test_delayed_parameter_initialization_comes_from_the_configuration() -> None:
    init(1, 1, "simple", delayed_parameter_initialization=True)
    with smp.model_creation(tensor_parallelism=True):
        delayed = nn.Linear(4, 4)
    assert delayed.weight.is_meta
    state._reset()
    init(1, 1, "simple")
    with smp.model_creation(tensor_parallelism=True):
        assert not nn.Linear(4, 4).weight.is_meta


def test_keywords_are_checked() -> None:
    with pytest.raises(smp.SMPConfigError, match="fused_softmaxx"):
        with smp.model_creation(fused_softmaxx=True):
            pass
    with pytest.raises(smp.SMPConfigError, match="dtype"):
        with smp.model_creation(dtype=torch.int64):
            pass
    init(1, 1, "simple", fp16=True)
    with pytest.raises(smp.SMPNotImplementedError, match="attention_in_fp32"):
        with smp.model_creation(tensor_parallelism=True, attention_in_fp32=True):
            pass
    # SMP's kernel switches and the distributed modules' arguments are taken
    with smp.model_creation(tensor_parallelism=True, fused_softmax=True, fused_dropout=False,
                            fused_bias_gelu=True, query_key_layer_scaling=True,
                            attention_in_fp32=False, hidden_dropout_prob=0.0):
        pass
