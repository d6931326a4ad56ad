"""SMP's activation-checkpointing API: marks, checks, and the functions outside smp."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from passes.partition_config import CheckpointRule
from smp_fx.marking import activation_checkpointing as ac
from tests.helpers.memory import mlp_stack
from tests.helpers.numerics import init


def test_marks_become_rules_by_module_path() -> None:
    net = nn.Sequential(mlp_stack(), nn.Linear(4, 4))
    smp.set_activation_checkpointing(net[0], strategy="group_2", preserve_rng_state=False)
    smp.set_activation_checkpointing(net[1])
    rules = ac.checkpoint_rules(net)
    assert [(r.module_path, r.strategy, r.preserve_rng_state) for r in rules] == [
        ("0", "group_2", False), ("1", "each", True)]
    assert rules[0].children == tuple(str(i) for i in range(11)) and rules[1].children == ()
    ac.clear(net)
    assert ac.checkpoint_rules(net) == ()


def test_attention_core_marks_any_module_and_is_no_sequential_grouping() -> None:
    net = nn.Sequential(mlp_stack(), nn.Linear(4, 4))
    smp.set_activation_checkpointing(net[1], strategy="attention_core")
    smp.set_activation_checkpointing(net[0], strategy="attention_core")
    rules = ac.checkpoint_rules(net)
    assert [(r.module_path, r.strategy, r.children) for r in rules] == [
        ("0", "attention_core", ()), ("1", "attention_core", ())]
    assert ac.rules_from_patterns(net, [":attention_core"]) == (
        CheckpointRule("", "attention_core"),)
    with pytest.raises(smp.SMPConfigError, match="set_activation_checkpointing"):
        smp.checkpoint_sequential(net[0], torch.ones(1, 16), strategy="attention_core")
    ac.clear(net)


def test_bad_marks_are_rejected() -> None:
    with pytest.raises(smp.SMPConfigError, match="strategy"):
        smp.set_activation_checkpointing(mlp_stack(), strategy="group_x")
    with pytest.raises(smp.SMPConfigError, match="nn.Sequential only"):
        smp.set_activation_checkpointing(nn.Linear(2, 2), strategy="contiguous")
    with pytest.raises(smp.SMPConfigError, match="nn.Module"):
        smp.set_activation_checkpointing("layer")  # type: ignore[arg-type]
    with pytest.raises(smp.SMPConfigError, match="nn.Sequential"):
        smp.checkpoint_sequential(nn.Linear(2, 2), torch.ones(1, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["each", "contiguous", "group_2"])
def test_the_functions_outside_smp_are_the_plain_model(strategy: str) -> None:
    """Without smp (no tracing) they run torch's checkpoint: same outputs and gradients,
    bitwise, dropout included."""
    torch.manual_seed(0)
    net = mlp_stack()
    x = torch.randn(4, 16)
    grads = []
    for run in (lambda: net(x), lambda: smp.checkpoint_sequential(net, x, strategy),
                lambda: smp.checkpoint(net, x)):
        net.zero_grad()
        torch.manual_seed(1)
        out = run()
        out.square().sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in net.parameters()]))
    for out, g in grads[1:]:
        assert torch.equal(out, grads[0][0])
        assert all(torch.equal(a, b) for a, b in zip(g, grads[0][1]))


class _Blocks(nn.Module):
    """Calls ``smp.checkpoint`` in its forward, as SMP scripts do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = smp.checkpoint(self.a, x)
        return self.c(smp.checkpoint(self.b, h))


def test_smp_checkpoint_in_a_forward_makes_regions() -> None:
    init(2, 2, "interleaved")
    torch.manual_seed(0)
    net = _Blocks()
    ref = _Blocks()
    ref.load_state_dict(net.state_dict())
    model = smp.DistributedModel(net)

    @smp.step
    def step(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).square().sum()
        model.backward(loss)
        return loss

    x = torch.randn(4, 8)
    loss = step(model, x).reduce_sum()
    regions = {r for st in model.plan.stages for r in st.checkpointed}
    assert regions == {"a", "b"}
    ref_loss = ref(x).square().sum()
    (ref_loss / 2).backward()  # the pipeline averages over its 2 microbatches
    torch.testing.assert_close(loss, ref_loss)
    for n, p in model.local_named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[n].grad)
    ac.clear(net)


def test_offloading_without_checkpointing_is_an_error() -> None:
    init(2, 2, "interleaved", offload_activations=True)
    model = smp.DistributedModel(mlp_stack())

    @smp.step
    def step(model: Any, x: torch.Tensor) -> Any:
        return model(x).sum()

    with pytest.raises(smp.SMPConfigError, match="no module is checkpointed"):
        step(model, torch.randn(4, 16))


def test_marking_after_partitioning_is_an_error() -> None:
    init(2, 2, "interleaved")
    net = mlp_stack()
    model = smp.DistributedModel(net)

    @smp.step
    def step(model: Any, x: torch.Tensor) -> Any:
        return model(x).sum()

    step(model, torch.randn(4, 16))
    with pytest.raises(smp.SMPConfigError, match="before the model is partitioned"):
        smp.set_activation_checkpointing(net[0])
