"""The Hugging Face Trainer's SMP mode as SMP ran it, for every transformers version.

Each release keeps an SMP branch whose expectations drifted: the device (CUDA hard-coded),
the data (accelerate shards by world size, not dp rank), the optimizer (5.x never builds
it) and clipping (each rank by its own norm). Each adjustment applies only in SMP mode,
under the shim directory, and is logged once. See docs/clients.md, 'Running the Trainer in
SMP mode' and the sections after it.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cost_model.errors import SMPConfigError

log = logging.getLogger("smp_fx.compat.hf_trainer")

LAUNCH_ENV = ("LOCAL_RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
              "MV2_COMM_WORLD_SIZE")
"""The variables accelerate reads to decide that it runs distributed."""

_TRAIN_SHARD: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "smp_fx_train_shard", default=None)


def _smp_mode() -> bool:
    from transformers.utils import is_sagemaker_mp_enabled

    return bool(is_sagemaker_mp_enabled())


def _version() -> str:
    import transformers

    return str(transformers.__version__)


class TorchWithCudaOnCpu(types.ModuleType):
    """torch, except that ``device("cuda", i)`` is the CPU and ``cuda.set_device`` does
    nothing; everything else is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(**vars(torch.cuda))
        self.cuda.set_device = lambda device: None

    def device(self, kind: Any, *index: Any) -> torch.device:
        return torch.device("cpu") if str(kind).startswith("cuda") else torch.device(kind, *index)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def after_training_args(module: types.ModuleType) -> None:
    """Without CUDA, point the SMP branch's hard-coded CUDA device at the CPU."""
    if not _smp_mode() or torch.cuda.is_available():
        return
    module.torch = TorchWithCudaOnCpu()  # type: ignore[attr-defined]
    log.info("no CUDA: transformers.training_args' SMP device cuda:<local rank> is the CPU")


def after_trainer(module: types.ModuleType) -> None:
    """Adjust the ``Trainer`` class of ``transformers.trainer`` (module doc)."""
    if not _smp_mode():
        return
    trainer = module.Trainer
    _build_missing_optimizer(trainer)
    if hasattr(trainer, "create_accelerator_and_postprocess"):
        _accelerate_not_distributed(trainer)
        _train_data_by_dp_rank(trainer)
        _clip_by_whole_model(trainer)


def _build_missing_optimizer(trainer: type) -> None:
    original = trainer.create_scheduler  # type: ignore[attr-defined]

    @functools.wraps(original)
    def create_scheduler(self: Any, num_training_steps: int, optimizer: Any = None) -> Any:
        if optimizer is None and self.optimizer is None:
            log.info("transformers %s built no optimizer in SMP mode; building the Trainer's "
                     "own (Trainer.create_optimizer)", _version())
            self.create_optimizer()
            if self.optimizer is None:
                raise SMPConfigError.build(
                    "the Trainer's SMP mode needs an optimizer, and this transformers "
                    "version builds none", f"transformers {_version()}",
                    "Trainer.create_scheduler",
                    "pass one: Trainer(..., optimizers=(torch.optim.AdamW(model.parameters(),"
                    " lr=args.learning_rate), None))")
            accelerator = getattr(self, "accelerator", None)
            if accelerator is not None:
                self.optimizer = accelerator.prepare(self.optimizer)
        return original(self, num_training_steps, optimizer)

    trainer.create_scheduler = create_scheduler  # type: ignore[attr-defined]


@contextmanager
def _launcher_hidden() -> Iterator[None]:
    """``LAUNCH_ENV`` out of ``os.environ`` for the duration (main thread, before any
    training thread exists)."""
    hidden = {name: os.environ.pop(name) for name in LAUNCH_ENV if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def _accelerate_not_distributed(trainer: type) -> None:
    original = trainer.create_accelerator_and_postprocess  # type: ignore[attr-defined]

    @functools.wraps(original)
    def create_accelerator_and_postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _launcher_hidden():
            result = original(self, *args, **kwargs)
        kind = str(self.accelerator.state.distributed_type).rsplit(".", 1)[-1]
        if kind != "NO":
            import accelerate

            raise SMPConfigError.build(
                "in SMP mode the Trainer's accelerator must not be distributed (smp-fx "
                "shards the data by data-parallel rank)",
                f"accelerate {accelerate.__version__}: {kind}", "Trainer.__init__",
                "do not configure accelerate's state before the Trainer in SMP mode "
                "(AcceleratorConfig(use_configured_state=True), accelerate launch)")
        log.info("SMP mode: the Trainer's accelerator is not distributed; training data is "
                 "sharded by data-parallel rank, evaluation reads every sample on every rank")
        return result

    trainer.create_accelerator_and_postprocess = (  # type: ignore[attr-defined]
        create_accelerator_and_postprocess)


def _train_data_by_dp_rank(trainer: type) -> None:
    import accelerate.accelerator as accelerator_module

    if not getattr(accelerator_module.prepare_data_loader, "smp_fx_shards", False):
        prepare = accelerator_module.prepare_data_loader

        @functools.wraps(prepare)
        def prepare_data_loader(*args: Any, **kwargs: Any) -> Any:
            shard = _TRAIN_SHARD.get()
            if shard is not None:
                kwargs["num_processes"], kwargs["process_index"] = shard
            return prepare(*args, **kwargs)

        prepare_data_loader.smp_fx_shards = True  # type: ignore[attr-defined]
        accelerator_module.prepare_data_loader = prepare_data_loader
    original = trainer.get_train_dataloader  # type: ignore[attr-defined]

    @functools.wraps(original)
    def get_train_dataloader(self: Any, *args: Any, **kwargs: Any) -> Any:
        size, index = int(self.args.world_size), int(self.args.process_index)
        token = _TRAIN_SHARD.set((size, index) if size > 1 else None)
        try:
            return original(self, *args, **kwargs)
        finally:
            _TRAIN_SHARD.reset(token)

    trainer.get_train_dataloader = get_train_dataloader  # type: ignore[attr-defined]


def _whole_model(params: Any) -> Any:
    """The partitioned ``DistributedModel`` whose ``parameters()`` are exactly ``params``
    (a model, or a list of tensors), else None."""
    from smp_fx.world import context

    model: Any = context.current_model()
    if model is None or not getattr(model, "partitioned", False):
        return None
    if params is model:
        return model
    given = params if isinstance(params, list) else None
    if given is None or {id(p) for p in given} != {id(p) for p in model.parameters()}:
        return None
    return model


def _clip_by_whole_model(trainer: type) -> None:
    original = trainer.create_accelerator_and_postprocess  # type: ignore[attr-defined]

    @functools.wraps(original)
    def create_accelerator_and_postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        accelerator = self.accelerator
        clip = accelerator.clip_grad_norm_

        @functools.wraps(clip)
        def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            params = list(parameters)
            model = _whole_model(params)
            if model is None:
                return clip(params, max_norm, norm_type)
            return model.clip_grad_norm_(max_norm, norm_type)

        accelerator.clip_grad_norm_ = clip_grad_norm_
        log.info("SMP mode: the Trainer clips gradients by the whole model's norm "
                 "(DistributedModel.clip_grad_norm_)")
        return result

    trainer.create_accelerator_and_postprocess = (  # type: ignore[attr-defined]
        create_accelerator_and_postprocess)
    if hasattr(trainer, "_mixed_mesh_grad_norm"):  # 5.x: DTensor gradients of several meshes
        mixed = trainer._mixed_mesh_grad_norm

        @functools.wraps(mixed)
        def _mixed_mesh_grad_norm(self: Any, model: Any, max_norm: float) -> Any:
            whole = _whole_model(model)
            return mixed(self, model, max_norm) if whole is None else \
                whole.clip_grad_norm_(max_norm)

        trainer._mixed_mesh_grad_norm = _mixed_mesh_grad_norm
