"""DistributedOptimizer: a real Optimizer for LR schedulers; steps only local parameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import smp_fx as smp
from smp_fx.optimizer import DistributedOptimizer
from smp_fx.parallel.build import OptimizerBinding
from smp_fx.world import state
from tests.helpers.numerics import init


def _binding(module: nn.Module, local: list[str]) -> OptimizerBinding:
    """What a partitioned model hands its optimizer: here ``local`` of ``module``'s
    parameters, none of them tensor-parallel shards, without fp16 or ZeRO-1."""
    return OptimizerBinding(tuple((n, p) for n, p in module.named_parameters() if n in local),
                            {}, lambda p: False, None, None)


def test_lr_scheduler_and_hyper_parameters() -> None:
    net = nn.Linear(2, 2)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.4, momentum=0.9))
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.2 and opt.param_groups[0]["momentum"] == 0.9
    assert opt.state is opt.optimizer.state and len(opt.state) == 2
    opt.zero_grad()
    assert net.weight.grad is None


def test_bind_keeps_local_parameters_and_their_global_index() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    inner = torch.optim.Adam([{"params": net[0].parameters(), "lr": 0.1},
                              {"params": net[1].parameters(), "lr": 0.2}])
    opt = DistributedOptimizer(inner)
    opt._names = {id(p): n for n, p in net.named_parameters()}
    opt.bind(_binding(net, ["1.weight", "1.bias"]))
    assert [len(g["params"]) for g in opt.param_groups] == [0, 2]
    assert opt.param_groups[1]["lr"] == 0.2
    assert sorted(opt.global_index.values()) == [2, 3]
    net(torch.ones(1, 2)).sum().backward()
    before = net[0].weight.clone()
    opt.step()  # only the local parameters move
    assert torch.equal(net[0].weight, before)


def test_bind_maps_recreated_parameters_by_name() -> None:
    net = nn.Linear(2, 2)
    opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1.0))
    opt._names = {id(p): n for n, p in net.named_parameters()}
    fresh = nn.Linear(2, 2)  # e.g. materialised from the meta device: new tensors
    opt.bind(_binding(fresh, ["weight", "bias"]))
    assert opt.param_groups[0]["params"][0] is fresh.weight
    opt.bind(_binding(net, ["weight"]))  # bound once: a second binding changes nothing
    assert opt.param_groups[0]["params"] == [fresh.weight, fresh.bias]


def test_with_a_distributed_model_and_step_lr() -> None:
    init(2, 2, "simple")
    try:
        net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)  # from the unwrapped model (seed)
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)

        @smp.step
        def train(model: Any, x: torch.Tensor) -> Any:
            out = model(x)
            model.backward(out.pow(2).mean())
            return out

        before = net[0].weight.clone()
        train(model, torch.randn(4, 4))
        opt.step()
        sched.step()
        assert not torch.equal(net[0].weight, before)
        assert abs(opt.param_groups[0]["lr"] - 0.01) < 1e-12
    finally:
        state._reset()


def test_only_an_optimizer_over_the_models_parameters_attaches_to_it() -> None:
    """The post-partition hook gets the first optimizer over the wrapped module's parameters;
    one over another module's parameters is not the model's."""
    init(2, 2, "simple")
    try:
        net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        model = smp.DistributedModel(net)
        other = nn.Linear(4, 4)
        foreign = smp.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1))
        assert model.owns_parameters(net.parameters())
        assert not model.owns_parameters(other.parameters())
        seen: list[Any] = []
        model.register_post_partition_hook(lambda m, o: seen.append(o))
        opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))

        @smp.step
        def fwd(model: Any, x: torch.Tensor) -> Any:
            return model(x)

        with torch.no_grad():
            fwd(model, torch.randn(4, 4))
        assert seen == [opt] and seen[0] is not foreign
        assert foreign.param_groups[0]["params"] == list(other.parameters())
    finally:
        state._reset()


def test_optimizer_built_before_the_model_is_adopted() -> None:
    """The Hugging Face Trainer's order: the optimizer exists before it wraps the model."""
    init(2, 2, "simple")
    try:
        net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        opt = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=0.1))
        assert opt._is_accelerate_prepared  # accelerate leaves it unwrapped
        assert not opt.step_was_skipped
        model = smp.DistributedModel(net)
        seen: list[Any] = []
        model.register_post_partition_hook(lambda m, o: seen.append(o))

        @smp.step
        def train(model: Any, x: torch.Tensor) -> Any:
            out = model(x)
            model.backward(out.pow(2).mean())
            return out

        train(model, torch.randn(4, 4))
        opt.step()
        assert seen == [opt] and opt._localized
        local = opt.local_state_dict(gather_if_shard=False)
        assert local["_smp_is_partial"] and set(local["state"]) == {
            n for n, _ in net.named_parameters()}
        assert all(t.device.type == "cpu" for s in local["state"].values() for t in s.values()
                   if isinstance(t, torch.Tensor))
    finally:
        smp.reset()
        state._reset()
