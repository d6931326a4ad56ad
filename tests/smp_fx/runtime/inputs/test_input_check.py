"""The first step checks that the ranks of a pipeline group were given the same batch."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.runtime.inputs.input_check import fingerprint
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


def _placeholder_body(mode: str) -> list[float] | str:
    """pp=2: the second rank passes empty tensors (AWS's DummyDataset), or real data that
    is the first rank's, or (``stray``) a placeholder on the second call only."""
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.manual_seed(0)
    model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    @smp.step
    def train(model: Any, x: torch.Tensor, labels: torch.Tensor) -> Any:
        loss = nn.functional.cross_entropy(model(x), labels)  # the rank's own labels
        model.backward(loss)
        return loss

    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3):
        x, labels = torch.randn(4, 4, generator=data), torch.randint(0, 3, (4,), generator=data)
        empty = mode == "placeholders" or (mode == "stray" and step == 1)
        if smp.pp_rank() == 1 and empty:
            x, labels = torch.empty(4, 0), torch.empty(4, 0)
        optimizer.zero_grad()
        try:
            losses.append(train(model, x, labels).reduce_mean().item())
        except smp.SMPRuntimeError as exc:
            return str(exc)
        optimizer.step()
    return losses


def _one_process() -> list[float]:
    smp.init({"pipeline_parallel_degree": 1})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, labels = torch.randn(4, 4, generator=data), torch.randint(0, 3, (4,), generator=data)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.multiproc
def test_placeholders_on_later_pipeline_ranks_take_the_first_ranks_inputs() -> None:
    """SMP v1's rule: the model inputs come from the first pipeline rank. The second rank's
    empty tensors are replaced by the first rank's, so the step function's loss from its
    labels and the last stage's inputs are the first rank's: losses equal one process."""
    want = run_ranks(_one_process, 1, timeout=60)[0]
    got = run_ranks(_placeholder_body, 2, "placeholders", timeout=120)
    assert got[0] == got[1]
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want), rtol=1e-5, atol=1e-6)
    first, second = run_ranks(_placeholder_body, 2, "stray", timeout=120)
    assert "a placeholder where the first call of this step function had real data" \
        in second and "argument 1" in second and "'rank': 1" in second
    assert "rank 1" in first  # it stops on its peer's failure, naming it


def _group_body(config: dict[str, Any]) -> list[str]:
    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 1, **config})
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    if smp.tp_size() > 1:
        smp.set_tensor_parallelism(module)
    model = smp.DistributedModel(module)

    @smp.step
    def train(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    out = []
    mine = smp.tp_rank() + smp.cp_rank()  # 1 on the second rank of the group
    # other examples on the group's second rank (a loader sharded by the global rank); the
    # same batch; a longer one on the second rank; the same batch again
    for length, seed in ((8, mine), (8, 0), (8 + 4 * mine, 0), (4, 0)):
        torch.manual_seed(seed)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                train(model, torch.randn(2, length, 8))
                out.append("trained")
            except smp.SMPRuntimeError as exc:
                out.append(str(exc))
        out[-1] += "".join(f"; warned: {w.message}" for w in said  # torch's renames
                           if issubclass(w.category, (FutureWarning, DeprecationWarning)))
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("group", ["tp", "cp"])
def test_ranks_splitting_a_batch_given_other_batches_fail_alike(group: str) -> None:
    """tp without prescaled_batch concatenates its ranks' batches: other shapes are refused
    on both ranks before the model runs (gloo aborted the process), other examples train.
    cp splits one batch's sequence: other shapes are refused, and other examples at the
    first call of the step function (they trained silently on a mix of sequences). The
    check warns of nothing (torch 2.13 deprecated the collective it used)."""
    config = ({"tensor_parallel_degree": 2, "prescaled_batch": False} if group == "tp"
              else {"context_parallel_degree": 2})
    for steps in run_ranks(_group_body, 2, config, timeout=120):
        assert steps[1] == steps[3] == "trained", steps
        rule = ("must be given batches of the same shapes" if group == "tp" else
                "every rank of a context-parallel group must be given the same batch")
        assert rule in steps[2] and "(2, 8, 8)" in steps[2] and "(2, 12, 8)" in steps[2]
        if group == "tp":
            assert steps[0] == "trained"
        else:
            assert rule in steps[0] and "the same shape, other values" in steps[0]
