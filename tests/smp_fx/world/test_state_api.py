"""smp.state.cfg, smp.state.module_manager and smp.reset(): what SMP clients read of the
process state (the Hugging Face Trainer reads cfg.fp16, cfg.prescaled_batch,
cfg.shard_optimizer_state and module_manager.translate_functions)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.world import context, state
from tests.helpers.numerics import init


def test_cfg_is_a_read_only_view_of_every_parameter() -> None:
    with pytest.raises(smp.SMPRuntimeError, match="smp.init"):
        smp.state.cfg  # noqa: B018 - the attribute read is the test
    init(2, 4, "simple", prescaled_batch=False)
    cfg = smp.state.cfg
    assert (cfg.pipeline_parallel_degree, cfg.partitions, cfg.microbatches) == (2, 2, 4)
    assert (cfg.fp16, cfg.prescaled_batch, cfg.shard_optimizer_state) == (False, False, False)
    assert cfg.get_config_dict() == state.get().config.values()
    with pytest.raises(AttributeError, match="read-only"):
        cfg.fp16 = True
    with pytest.raises(AttributeError, match="did you mean 'microbatches'"):
        cfg.microbatch  # noqa: B018
    assert cfg.bf16 is False  # SMP 1.11+
    assert not hasattr(cfg, "fp8")  # hasattr works: unknown names are AttributeErrors


def test_module_manager_translate_functions() -> None:
    manager = smp.state.module_manager
    assert manager.translate_functions == []  # smp-fx keeps the module's own names

    def to_hf(sd: dict) -> dict:
        return {k.replace("smp.", ""): v for k, v in sd.items()}

    manager.register_translate_function((to_hf, lambda sd: sd))
    assert [f for f, _ in smp.state.module_manager.translate_functions] == [to_hf]
    smp.reset()
    assert smp.state.module_manager.translate_functions == []


def test_reset_forgets_the_model_but_keeps_init() -> None:
    init(1, 1, "simple")
    model = smp.DistributedModel(nn.Linear(2, 2))
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert context.current_model() is model and context.current_optimizer() is not None
    smp.reset()
    assert context.current_model() is None and context.current_optimizer() is None
    assert smp.is_initialized() and smp.state.cfg.pipeline_parallel_degree == 1
    again = smp.DistributedModel(nn.Linear(2, 2))  # a new model trains in the same process

    @smp.step
    def fwd(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    with torch.no_grad():
        assert fwd(again, torch.ones(2, 2)).concat().shape == (2, 2)
