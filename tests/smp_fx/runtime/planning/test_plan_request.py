"""One planning request (``smp_fx.runtime.planning.plan_request``): what it takes from the
configuration and the model's marks, and that ``smp-fx partition`` (parsing its
configuration once) and ``DistributedModel`` ask the compiler the same one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from cost_model.devices import A100
from passes.tensor_parallel import TensorParallelism
from smp_fx.cli import partition as partition_cli
from smp_fx.config import load_config
from smp_fx.runtime.planning import plan_request as request_module
from smp_fx.runtime.planning import planning
from smp_fx.runtime.planning.plan_request import PlanRequest, plan_request
from smp_fx.world import state

MODELS = Path(__file__).resolve().parents[4] / "examples" / "models"


def test_the_request_takes_the_configuration_and_the_marks() -> None:
    """Pins under manual partitioning, the marked checkpointed modules, this rank's
    tensor-parallel rewrite, the spec with ``pipelined_scale`` folded in; the CLI's
    patterns and optimizer state factor replace the marks and the default."""
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    smp.set_partition(net[2], 1)
    smp.set_activation_checkpointing(net[0])
    smp.set_tensor_parallelism(net[2])
    cfg = load_config({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True,
                       "auto_partition": False, "default_partition": 0,
                       "tensor_parallel_degree": 2, "optimize": "speed"}, env={})
    spec = dataclasses.replace(A100, pipelined_scale=1.5)
    request = plan_request(cfg, net, spec, tp_rank=1)
    assert request.device.pipelined_scale == 1.0
    assert request.device.compute_scale == pytest.approx(1.5 * A100.compute_scale)
    assert request.pins == (("2", 1),)
    assert [rule.module_path for rule in request.config.checkpointing] == ["0"]
    assert request.tp == TensorParallelism(2, 1, False, ("2",))
    assert request.config == cfg.partition_config(A100.name, 2.0, request.config.checkpointing)

    auto = load_config({"pipeline_parallel_degree": 2}, env={})
    plain = plan_request(auto, net, spec, tp_rank=0, checkpointing=(),
                         optimizer_state_factor=0.5)
    assert plain.pins is None and plain.tp is None and plain.config.checkpointing == ()
    assert plain.config.optimizer_state_factor == 0.5


def _spy(found: list[PlanRequest]) -> Any:
    def recorded(*args: Any, **kwargs: Any) -> PlanRequest:
        found.append(request_module.plan_request(*args, **kwargs))
        return found[-1]
    return recorded


def test_partition_and_distributed_model_ask_the_same_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same model file (pinned by hand), configuration and spec: one request each, equal;
    the CLI parses the configuration once."""
    offline: list[PlanRequest] = []
    runtime: list[PlanRequest] = []
    parsed: list[Any] = []
    load = partition_cli.load_config
    monkeypatch.setattr(partition_cli, "plan_request", _spy(offline))
    monkeypatch.setattr(planning, "plan_request", _spy(runtime))
    monkeypatch.setattr(partition_cli, "load_config",
                        lambda *a, **k: parsed.append(a) or load(*a, **k))
    config = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": False,
              "default_partition": 1}
    path = tmp_path / "smp.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    model_file = str(MODELS / "mlp_manual.py")
    assert partition_cli.main([model_file, "--config", str(path), "--batch-size", "4",
                               "--device", "a100", "--quiet"]) == 0
    assert len(parsed) == 1

    monkeypatch.setenv("SMP_FX_DEVICE_SPEC", "a100")
    example = partition_cli.load_model_file(model_file)
    state._reset()
    smp.init(config)
    try:
        model = smp.DistributedModel(example.build_model())

        @smp.step
        def forward(model: Any, x: torch.Tensor) -> Any:
            return model(x)

        with torch.no_grad():
            forward(model, *example.example_inputs(4))
    finally:
        state._reset()
    assert len(offline) == len(runtime) == 1
    assert offline[0].pins is not None and offline[0] == runtime[0]
