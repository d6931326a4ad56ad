"""The Trainer adjustments on their own (the whole Trainer runs in
``tests/examples/test_hf_trainer.py``): the missing optimizer is built or named with the
fix, the launcher's variables are hidden only while accelerate looks, clipping with the
model's parameters goes to the model's whole-model clipping, and the post-import hooks run a
hook right after a module's first import."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cost_model.errors import SMPConfigError
from smp_fx._compat import SHIM_DIR, hf_trainer

pytest.importorskip("transformers")


class _Trainer:
    """What the wrapper reads of a Trainer: an optimizer slot and the two methods."""

    def __init__(self, builds: bool) -> None:
        self.optimizer: Any = None
        self.builds = builds
        self.scheduled_with: Any = "unset"

    def create_optimizer(self) -> Any:
        if self.builds:
            self.optimizer = "the Trainer's optimizer"
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        self.scheduled_with = self.optimizer
        return num_training_steps


def test_missing_optimizer_is_built_or_named() -> None:
    hf_trainer._build_missing_optimizer(_Trainer)
    trainer = _Trainer(builds=True)
    assert trainer.create_scheduler(4) == 4
    assert trainer.scheduled_with == "the Trainer's optimizer"
    given = _Trainer(builds=True)
    given.optimizer = "passed in"  # a version that built one (or a script that passed one)
    given.create_scheduler(4)
    assert given.scheduled_with == "passed in"
    with pytest.raises(SMPConfigError, match=r"transformers \d.*optimizers=\(torch.optim"):
        _Trainer(builds=False).create_scheduler(4)


class _Partitioned:
    """What the clipping reads of a partitioned DistributedModel."""

    partitioned = True

    def __init__(self) -> None:
        self.params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
        self.clipped: list[float] = []

    def parameters(self) -> Any:
        return iter(self.params)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.clipped.append(max_norm)
        return torch.tensor(7.0)


class _Accelerator:
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        return "accelerate", len(list(parameters))


class _ClipTrainer:
    def create_accelerator_and_postprocess(self) -> None:
        self.accelerator = _Accelerator()

    def _mixed_mesh_grad_norm(self, model: Any, max_norm: float) -> Any:
        return "its own"


def test_clipping_with_the_models_parameters_is_the_whole_models() -> None:
    from smp_fx.world import context

    hf_trainer._clip_by_whole_model(_ClipTrainer)
    trainer = _ClipTrainer()
    trainer.create_accelerator_and_postprocess()
    model = _Partitioned()
    context.set_current_model(model)  # type: ignore[arg-type]
    try:
        assert float(trainer.accelerator.clip_grad_norm_(model.parameters(), 1.0)) == 7.0
        assert float(trainer._mixed_mesh_grad_norm(model, 2.0)) == 7.0
        assert model.clipped == [1.0, 2.0]
        # other tensors than the model's: accelerate's own clipping
        assert trainer.accelerator.clip_grad_norm_(model.params[:1], 1.0) == ("accelerate", 1)
        model.partitioned = False  # before the first step: nothing to clip by the model
        assert trainer.accelerator.clip_grad_norm_(model.parameters(), 1.0) == ("accelerate", 2)
        assert model.clipped == [1.0, 2.0]
    finally:
        context.clear_current_model()


def test_launcher_variables_hidden_only_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    with hf_trainer._launcher_hidden():
        assert "LOCAL_RANK" not in os.environ and "OMPI_COMM_WORLD_SIZE" not in os.environ
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["OMPI_COMM_WORLD_SIZE"] == "4"


def test_not_in_smp_mode_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.trainer as trainer_module

    monkeypatch.delenv("SM_HP_MP_PARAMETERS", raising=False)
    before = dict(vars(trainer_module.Trainer))
    hf_trainer.after_trainer(trainer_module)
    assert dict(vars(trainer_module.Trainer)) == before


def test_post_import_hook_runs_after_the_module(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hooked_mod.py").write_text("VALUE = 1\n")
    (tmp_path / "hook_target.py").write_text(
        "def after(module):\n    module.VALUE += 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(SHIM_DIR))
    hooks = importlib.import_module("smp_fx_import_hooks")
    monkeypatch.setitem(hooks.HOOKS, "hooked_mod", "hook_target:after")
    saved = list(sys.meta_path)
    try:
        hooks.install()
        hooks.install()  # once
        assert sum(isinstance(f, hooks._Finder) for f in sys.meta_path) == 1
        assert importlib.import_module("hooked_mod").VALUE == 2
    finally:
        sys.meta_path[:] = saved
        for name in ("hooked_mod", "hook_target", "smp_fx_import_hooks"):
            sys.modules.pop(name, None)
