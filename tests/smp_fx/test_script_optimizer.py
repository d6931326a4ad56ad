"""A script's own optimizer object under ``smp.DistributedOptimizer``: the wrapper narrows the
torch optimizer the object holds to this rank's parameters, passes the object's methods and
attributes through, and checkpoints that torch optimizer's state by parameter name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.world import state
from tests.helpers.numerics import init


class MasterOptimizer:
    """A Megatron-style plain object (the shape of AWS's ``FP16_Optimizer``): fp32 masters
    of the model's parameters made by ``init_master_params`` (SMP scripts call it once the
    model is partitioned), a static loss scale applied in ``backward``, clipping of the
    masters' gradients."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, scale: float) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_scale = scale
        self.overflow = False
        self.fp32paramid_from_fp16paramid: dict[int, int] = {}
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.zeroed_with: list[dict[str, Any]] = []

    def init_master_params(self) -> None:
        for group in self.optimizer.param_groups:
            masters = []
            for p in group["params"]:
                m = nn.Parameter(p.detach().clone())
                self.pairs.append((p, m))
                self.fp32paramid_from_fp16paramid[id(p)] = id(m)
                masters.append(m)
            group["params"] = masters

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss * self.loss_scale)

    def update_master_grads(self) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.detach() / self.loss_scale

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs], max_norm, norm_type)

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803 - its name
        self.zeroed_with.append({"set_grads_to_None": set_grads_to_None})
        for p, m in self.pairs:
            p.grad = m.grad = None

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def _train(model: Any, own: Any, opt: Any, batches: list[torch.Tensor]) -> list[float]:
    @smp.step
    def step(model: Any, x: torch.Tensor) -> Any:
        loss = model(x).pow(2).mean()
        opt.backward(loss)
        return loss

    losses = []
    for x in batches:
        opt.zero_grad(set_grads_to_None=True)
        loss = step(model, x).reduce_mean()
        opt.update_master_grads()
        opt.clip_master_grads(0.5)
        opt.step()
        losses.append(float(loss))
    return losses


def test_a_scripts_own_optimizer_object_trains_as_one_process() -> None:
    batches = [torch.randn(4, 4) for _ in range(3)]
    ref = _net()
    want = []
    plain = MasterOptimizer(None, torch.optim.SGD(ref.parameters(), lr=0.1), 8.0)
    plain.model = type("M", (), {"backward": staticmethod(lambda loss: loss.backward())})()
    plain.init_master_params()
    for x in batches:
        plain.zero_grad(set_grads_to_None=True)
        loss = ref(x).pow(2).mean()
        plain.backward(loss)
        plain.update_master_grads()
        plain.clip_master_grads(0.5)
        plain.step()
        want.append(float(loss.detach()))

    init(2, 2, "simple")
    try:
        net = _net()
        model = smp.DistributedModel(net)
        own = MasterOptimizer(model, torch.optim.SGD(net.parameters(), lr=0.1), 8.0)
        opt = smp.DistributedOptimizer(own)
        model.register_post_partition_hook(lambda m, o: o.init_master_params())
        got = _train(model, own, opt, batches)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, msg=name)
        assert opt.loss_scale == 8.0 and opt.overflow is False
        assert own.zeroed_with[-1] == {"set_grads_to_None": True}
        assert opt.param_groups is own.optimizer.param_groups
        # SMP's private index map, masters by the model parameter behind them
        index = opt._param_id_to_index()
        assert sorted(index.values()) == [0, 1, 2, 3]
        assert {index[id(m)] for _, m in own.pairs} == {0, 1, 2, 3}
        assert not opt.redefined_params
        # the torch optimizer's state is checkpointed by parameter name
        full = opt.state_dict()
        assert len(full["param_groups"][0]["params"]) == 4
    finally:
        state._reset()


def test_an_object_without_a_torch_optimizer_is_refused() -> None:
    with pytest.raises(smp.SMPError, match="holding one as '.optimizer'"):
        smp.DistributedOptimizer(object())  # type: ignore[arg-type]


def test_fp16_with_a_scripts_own_object_names_the_fix() -> None:
    init(1, 1, "simple", fp16=True)
    try:
        net = _net()
        model = smp.DistributedModel(net)
        own = MasterOptimizer(model, torch.optim.SGD(net.parameters(), lr=0.1), 1.0)
        opt = smp.DistributedOptimizer(own)

        @smp.step
        def fwd(model: Any, x: torch.Tensor) -> Any:
            return model(x)

        with pytest.raises(smp.SMPError, match="drop the script's FP16_Optimizer"):
            with torch.no_grad():
                fwd(model, torch.randn(2, 4))
        assert opt.optimizer is own
    finally:
        state._reset()
