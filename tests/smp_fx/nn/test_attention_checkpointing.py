"""``"checkpoint_attentions": true``: the attention cores of SMP's transformer become
checkpointed regions (selective recomputation); the numerics are the model's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import smp_fx as smp
from smp_fx.marking import activation_checkpointing as ac
from tests.helpers.numerics import init


class _Lm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.body = smp.nn.DistributedTransformer(
            num_layers=2, num_attention_heads=2, attention_head_size=4, hidden_size=8,
            intermediate_size=16, attention_dropout_prob=0.0, hidden_dropout_prob=0.0)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        mask = torch.zeros(x.shape[0], 1, 1, x.shape[1])
        return self.head(self.body((h, mask))[0])


@smp.step
def _step(model: Any, x: torch.Tensor) -> Any:
    loss = model(x).square().mean()
    model.backward(loss)
    return loss


def test_attention_layers_become_regions_and_train_as_the_model(one_thread: None) -> None:
    init(2, 2, "simple", checkpoint_attentions=True)
    torch.manual_seed(0)
    net, ref = _Lm(), _Lm()
    ref.load_state_dict(net.state_dict())
    smp.set_activation_checkpointing(net.body.seq_layers[1])  # a layer around one already
    model = smp.DistributedModel(net)
    x = torch.randn(4, 5, 4)
    loss = _step(model, x).reduce_mean()
    regions = {r for st in model.plan.stages for r in st.checkpointed}
    assert regions == {"body.seq_layers.0.attention.attention_core", "body.seq_layers.1"}
    ref_loss = ref(x).square().mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for n, p in model.local_named_parameters():
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[n].grad)
    ac.clear(net)


def test_the_configuration_turns_the_overlap_off(one_thread: None) -> None:
    init(1, 1, "simple", overlapping_allreduce=False)
    assert not smp.DistributedModel(nn.Linear(2, 2)).options.overlapping_allreduce
    init(1, 1, "simple")
    assert smp.DistributedModel(nn.Linear(2, 2)).options.overlapping_allreduce
