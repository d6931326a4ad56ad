"""The experts' replacement and the dispatch op, in one process (ep 1: no all-to-all).

DeepSeek-V3 of ``examples/models/moe_zoo.py`` (grouped sigmoid routing, a shared expert;
the other families run at ep 2 in ``test_expert_parallel``) with its experts replaced
computes the plain model's logits and gradients through ``torch.ops.smp_fx.ep_experts``
(its recomputing backward included); a module that looks like experts in a layout the split
does not know stays replicated, with its reason.
"""

from __future__ import annotations

import torch
from torch import nn

import smp_fx as smp
from examples.models import moe_zoo
from smp_fx.parallel.ep_experts import ExpertParallelExperts, activation_name, replace_experts
from smp_fx.world import state

TOL = {"atol": 1e-5, "rtol": 1e-5}


def test_replaced_experts_compute_the_plain_model(arch: str = "deepseek_v3") -> None:
    smp.init({"pipeline_parallel_degree": 1})
    plain, split = moe_zoo.build(arch), moe_zoo.build(arch)
    blocks = replace_experts(split, 1, 0, None)
    assert [b.reason for b in blocks] == ["", ""]
    assert sum(isinstance(m, ExpertParallelExperts) for m in split.modules()) == 2
    x, y = moe_zoo.inputs(3), moe_zoo.targets(3)
    for model in (plain, split):
        out = model(*x)
        torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()).backward()
    torch.testing.assert_close(split(*x), plain(*x), **TOL)
    grads = dict(plain.named_parameters())
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, **TOL, msg=name)


class BiasedExperts(nn.Module):
    """Experts with biases (gpt-oss's layout): not split."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 4))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 8))
        self.down_proj = nn.Parameter(torch.zeros(4, 4, 4))
        self.act_fn = nn.SiLU()


def test_experts_in_another_layout_stay_replicated_with_the_reason() -> None:
    smp.init({"pipeline_parallel_degree": 1})
    model = nn.Sequential(BiasedExperts())
    blocks = replace_experts(model, 2, 0, state.get())
    assert [b.line() for b in blocks] == ["0: replicated (4 experts): experts with biases"]
    assert isinstance(model[0], BiasedExperts)


def test_activation_matched_by_value() -> None:
    assert activation_name(nn.SiLU()) == "silu" and activation_name(nn.GELU()) == "gelu"
    assert activation_name(nn.Tanh()) is None
