"""``smp.tp_register`` / ``smp.tp_register_with_module``: a registered class's marked
instances become its distributed version at ``DistributedModel`` time, built by the
init hook from the recorded arguments, called through the forward / return hooks; the
fx rewrite then shards it; registration errors name the rule."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from passes.shape_prop import shape_prop
from passes.tensor_parallel import TensorParallelism, tensor_parallel
from passes.trace import trace
from smp_fx.marking.tensor_parallelism import marked_paths
from smp_fx.marking.tp_register import registration, replace_registered
from tests.helpers.numerics import init

CONFIG = {"num_layers": 1, "num_attention_heads": 4, "attention_head_size": 4,
          "hidden_size": 16, "intermediate_size": 32, "attention_dropout_prob": 0.0,
          "hidden_dropout_prob": 0.0}


class Config:
    def __init__(self, **values: Any) -> None:
        self.values = values

    def to_dict(self) -> dict[str, Any]:
        return dict(self.values)


@smp.tp_register(smp.nn.DistributedTransformer,
                 init_hook=lambda config: ((), config.to_dict()),
                 forward_hook=lambda hidden_states, attention_mask: (
                     ((hidden_states, attention_mask),), {}),
                 return_hook=lambda out: out[0])
class MyTransformer(nn.Module):
    """SMP's example: a user's transformer with its own interface (a config object;
    forward(hidden_states, attention_mask) returning one tensor)."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor
                ) -> torch.Tensor:
        return self.proj(hidden_states)


class MyMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 hidden_dropout_prob: float = 0.1) -> None:
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)


smp.tp_register_with_module(MyMLP, smp.nn.DistributedTransformerOutputLayer)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        with smp.tensor_parallelism():
            self.body = MyTransformer(Config(**CONFIG))
        self.plain = MyTransformer(Config(**CONFIG))  # not marked: stays the user's
        self.mlp = MyMLP(16, 32, hidden_dropout_prob=0.0)
        smp.set_tensor_parallelism(self.mlp)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.plain(self.body(self.inp(x), mask), mask))


def test_marked_instances_are_replaced_and_called_through_the_hooks() -> None:
    torch.manual_seed(0)
    net = replace_registered(Net())
    assert isinstance(net.body, smp.nn.DistributedTransformer)
    assert net.body.num_layers == 1 and len(net.body.seq_layers) == 1
    assert net.body.seq_layers[0].attention.query.weight.shape == (16, 16)
    assert type(net.plain) is MyTransformer
    assert type(net.mlp) is smp.nn.DistributedTransformerOutputLayer  # no hooks: the class
    assert net.mlp.dense1.weight.shape == (32, 16)
    x, mask = torch.randn(2, 5, 8), torch.zeros(2, 1, 1, 5)
    hidden = smp.nn.DistributedTransformer.forward(net.body, (net.inp(x), mask))[0]
    torch.testing.assert_close(net(x, mask), net.mlp(net.plain(hidden, mask)))
    reg = registration(MyTransformer)
    assert reg is not None and reg.dist_module is smp.nn.DistributedTransformer


def test_the_replacement_is_sharded_by_the_rewrite() -> None:
    torch.manual_seed(0)
    net = replace_registered(Net())
    x, mask = torch.randn(2, 5, 8), torch.zeros(2, 1, 1, 5)
    gm = shape_prop(trace(net, (x, mask), {}, frontend="fx"), (x, mask))
    assert gm.meta["smp.auto_leaves"] == ()
    _, plan = tensor_parallel(gm, TensorParallelism(2, 0, True, marked_paths(net)))
    assert plan.replicated == ()
    names = {s.name for s in plan.sharded}
    assert {"body.seq_layers.0.attention.query.weight", "body.seq_layers.0.output.dense2.weight",
            "mlp.dense1.weight", "mlp.dense2.weight"} <= names
    assert not any(n.startswith("plain.") for n in names)


@pytest.fixture
def fresh(one_thread: None) -> None:
    init(1, 2, "simple")


def test_distributed_model_replaces_before_tracing(fresh: None) -> None:
    torch.manual_seed(0)
    net = Net()
    model = smp.DistributedModel(net)
    assert isinstance(net.body, smp.nn.DistributedTransformer)
    names = {n for n, _ in model.named_parameters()}
    assert "body.seq_layers.0.attention.query.weight" in names and "body.proj.weight" not in names
    x, mask = torch.randn(4, 5, 8), torch.zeros(4, 1, 1, 5)
    want = net(x, mask)

    @smp.step
    def run(model: Any, x: torch.Tensor, mask: torch.Tensor) -> Any:
        return model(x, mask)

    got = torch.cat(run(model, x, mask).outputs)
    torch.testing.assert_close(got, want)


def test_hooks_may_differ_from_the_method_in_defaults_only(
        caplog: pytest.LogCaptureFixture) -> None:
    """AWS's ViT hooks declare other defaults than the forward's: accepted, logged."""
    caplog.set_level(logging.DEBUG, "smp_fx.marking.tp_register")
    smp.tp_register_with_module(
        MyMLP, smp.nn.DistributedTransformerOutputLayer,
        init_hook=lambda hidden_size, intermediate_size, hidden_dropout_prob=0.0: ((), {}),
        forward_hook=lambda x: ((x,), {}))
    assert "init_hook differs from MyMLP.__init__ only in defaults" in caplog.text
    assert "hidden_dropout_prob=0.0 (method: 0.1)" in caplog.text
    assert "forward_hook" not in caplog.text
    with pytest.raises(smp.SMPConfigError, match="init_hook must have the signature"):
        smp.tp_register_with_module(  # a keyword-only parameter is another kind
            MyMLP, smp.nn.DistributedTransformerOutputLayer,
            init_hook=lambda hidden_size, intermediate_size, *, hidden_dropout_prob=0.1:
            ((), {}))
    smp.tp_register_with_module(MyMLP, smp.nn.DistributedTransformerOutputLayer)


def test_registration_errors_name_the_rule() -> None:
    with pytest.raises(smp.SMPConfigError, match="init_hook must have the signature"):
        smp.tp_register_with_module(MyMLP, smp.nn.DistributedTransformerOutputLayer,
                                    init_hook=lambda hidden_size: ((), {}))
    with pytest.raises(smp.SMPConfigError, match="forward_hook must have the signature"):
        smp.tp_register_with_module(MyMLP, smp.nn.DistributedTransformerOutputLayer,
                                    forward_hook=lambda y: ((y,), {}))
    with pytest.raises(smp.SMPConfigError, match="dist_module must be an nn.Module"):
        smp.tp_register(object)  # type: ignore[arg-type]
    with pytest.raises(smp.SMPConfigError, match="return_hook must be callable"):
        smp.tp_register_with_module(MyMLP, smp.nn.DistributedTransformerOutputLayer,
                                    return_hook=3)  # type: ignore[arg-type]

    class Early(nn.Module):
        def __init__(self, width: int = 16) -> None:
            super().__init__()
            self.fc = nn.Linear(width, width)

    holder = nn.Sequential(Early())
    smp.set_tensor_parallelism(holder)
    smp.tp_register_with_module(Early, smp.nn.DistributedTransformerOutputLayer)
    with pytest.raises(smp.SMPConfigError, match="built before the registration"):
        replace_registered(holder)
    root = Early()
    smp.set_tensor_parallelism(root)
    replaced = replace_registered(root)  # the root too: DistributedModel wraps the new one
    assert isinstance(replaced, smp.nn.DistributedTransformerOutputLayer)
    assert replaced is not root

    class Sub(MyMLP):
        pass

    sub = nn.Sequential(Sub(16, 32))
    smp.set_tensor_parallelism(sub)
    assert type(replace_registered(sub)[0]) is Sub  # the exact class only
