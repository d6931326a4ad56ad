"""The Hugging Face Trainer's SMP mode as SMP ran it, for every transformers version.

Each transformers release from 4.2x to 5.x keeps an SMP branch in its ``Trainer``; what
that branch expects of the world around it drifted. Run unmodified under smp-fx, three
things would go wrong, none of them in smp-fx's API:

* **The device.** ``TrainingArguments`` in SMP mode hard-codes
  ``torch.device("cuda", smp.local_rank())`` and ``torch.cuda.set_device``. On a host
  without CUDA, ``after_training_args`` gives ``transformers.training_args`` (that module
  only) a view of torch whose ``device("cuda", i)`` is the CPU and whose
  ``cuda.set_device`` does nothing.
* **The data** (4.3x and later). The Trainer no longer picks a sampler by
  ``smp.dp_rank()``: it hands its loaders to accelerate, which shards them by the world
  size whenever it thinks it runs distributed (``LOCAL_RANK``, ``WORLD_SIZE`` or an MPI
  size in the environment; on CPU too with accelerate 1.1), so the ranks of one pipeline
  get different batches; and it gathers evaluation results over the whole world. SMP's
  rule is that data is sharded by data-parallel rank (``TrainingArguments.world_size`` /
  ``process_index`` say so in SMP mode: ``smp.dp_size()`` / ``smp.dp_rank()``, the
  rdp figures under ``prescaled_batch``). So, in SMP mode only, the Trainer's
  ``Accelerator`` is created without the launcher's variables in sight (accelerate is
  then not distributed, as the SMP branch of ``TrainingArguments`` intends when it turns
  accelerate's state off), and the training loader (``get_train_dataloader``) is
  sharded by accelerate itself over ``args.world_size`` replicas at
  ``args.process_index``. Evaluation and prediction loaders stay whole: every rank
  evaluates every sample and nothing needs gathering, so the results equal the plain
  Trainer's whatever the data-parallel degree.
* **The optimizer** (5.x). Its SMP branch delays creating the optimizer until the model
  is wrapped, then skips creating it for a wrapped model, and the scheduler fails on
  ``None``. ``Trainer.create_scheduler`` is called right after; when it finds no
  optimizer in SMP mode it now first builds the one the Trainer would have built
  (``Trainer.create_optimizer``, which wraps it in ``smp.DistributedOptimizer``) and
  prepares it with the accelerator as that version prepares one passed in. Versions that
  build their optimizer never reach that case. If none can be built, training stops
  there with an ``SMPConfigError`` naming the version and the one-line fix.

Everything here runs only in the Trainer's SMP mode (``is_sagemaker_mp_enabled()``), only
under the shim directory (``smp-fx run``, or ``PYTHONPATH`` set to it), and each
adjustment is logged once. The hooks are called by ``smp_fx_import_hooks`` (in the shim
directory) right after the module is first imported.
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
