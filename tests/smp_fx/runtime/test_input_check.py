"""The first step checks that the ranks of a pipeline group were given the same batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.runtime.input_check import fingerprint
from tests.helpers.dist import run_ranks


def test_fingerprint_sees_every_nested_tensor_and_nothing_else() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    labels = torch.ones(2, dtype=torch.long)
    prints = fingerprint((nn.Linear(1, 1), x), {"batch": {"labels": [labels]}, "flag": True})
    assert prints == [("argument 1", (2, 3), "torch.float32", *_hex(15, 55, 70)),
                      ("argument 'batch'['labels'][0]", (2,), "torch.int64", *_hex(2, 2, 3))]
    moved = x.clone()
    moved[0, 0], moved[1, 2] = 5.0, 0.0  # the same values in other places
    assert fingerprint((moved,), {}) != fingerprint((x,), {})
    nan = torch.tensor([1.0, float("nan")])
    assert fingerprint((nan,), {}) == fingerprint((nan.clone(),), {})


def _hex(*values: float) -> list[str]:
    return [float(v).hex() for v in values]


def _body(same: bool) -> str:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))

    @smp.step
    def train(model: Any, x: torch.Tensor, labels: torch.Tensor) -> Any:
        loss = nn.functional.cross_entropy(model(x), labels)
        model.backward(loss)
        return loss

    torch.manual_seed(0 if same else smp.rank())  # a loader sharded by the global rank
    x, labels = torch.randn(4, 4), torch.randint(0, 2, (4,))
    try:
        train(model, x, labels)
    except smp.SMPRuntimeError as exc:
        return str(exc)
    return "trained"


@pytest.mark.multiproc
@pytest.mark.parametrize("same", [True, False])
def test_pipeline_ranks_given_other_batches_fail_at_the_first_step(same: bool) -> None:
    results = run_ranks(_body, 2, same, timeout=120)
    if same:
        assert results == ["trained", "trained"]
        return
    for message in results:
        assert "every rank of a pipeline group must be given the same batch" in message
        assert "argument 1" in message and "'ranks': [0, 1]" in message
        assert "smp.dp_rank()" in message
