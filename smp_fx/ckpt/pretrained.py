"""Hugging Face ``from_pretrained`` under ``smp.delay_param_initialization``: built on the
meta device, each rank reading only its own stage's tensors once partitioned.

Only ``PreTrainedModel.from_pretrained`` changes, only inside the context.
See docs/checkpoints.md, 'Files, crash safety and formats'.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt.hf_weights import find_hf_weights
from smp_fx.marking.init_tape import paused

PRETRAINED_ATTR = "_smp_pretrained_files"
"""Attribute of a model built by ``meta_from_pretrained``: its safetensors files."""

MODEL_KWARGS = ("torch_dtype", "dtype", "attn_implementation")
"""``from_pretrained`` keywords passed on to the model's construction; the others concern
downloading and loading weights, which is done later, per stage."""


def _safe_open(file: str) -> Any:
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise SMPCheckpointError.build(
            "reading .safetensors weights needs the safetensors package", file,
            fix="pip install safetensors (transformers installs it)") from exc
    return safe_open(file, framework="pt", device="cpu")


class SafetensorsState(Mapping[str, torch.Tensor]):
    """The tensors of safetensors files as a read-only mapping: the names are read up front,
    a tensor only when it is looked up (from the file's memory map)."""

    def __init__(self, files: list[str]) -> None:
        self.files = list(files)
        self._where: dict[str, str] = {}
        for file in self.files:
            with _safe_open(file) as fh:
                for name in fh.keys():
                    if name in self._where:
                        raise SMPCheckpointError.build(
                            "a tensor appears in two weight files", name, where=file,
                            fix="use the folder's own index")
                    self._where[name] = file

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._where[name]  # KeyError for a name the files lack, as a dict
        with _safe_open(file) as fh:
            return fh.get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def pretrained_files(module: nn.Module) -> list[str] | None:
    """The weight files ``meta_from_pretrained`` recorded on ``module`` (None: none)."""
    files = getattr(module, PRETRAINED_ATTR, None)
    return list(files) if files else None


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (each is allocated
    for the moment of its registration only) and their buffers where they are computed."""

    def to_meta(module: nn.Module, name: str, param: Any) -> Any:
        if param is None or param.is_meta:  # a tie assigns a parameter already on meta
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = module_mod.register_module_parameter_registration_hook(to_meta)
    try:
        # inside delay_param_initialization's meta device and record: the weights come
        # from the files, so their construction is not recorded (nor held as constants)
        with torch.device("cpu"), paused():
            yield
    finally:
        handle.remove()


def _from_pretrained(cls: Any, folder: Any, *args: Any, **kwargs: Any) -> Any:
    if args:
        raise SMPCheckpointError.build(
            "from_pretrained under smp.delay_param_initialization takes keywords only",
            args, where=f"{cls.__name__}.from_pretrained",
            fix="pass the folder and keywords (config=..., torch_dtype=...)")
    files = find_hf_weights(os.fspath(folder)) if os.path.isdir(os.fspath(folder)) else []
    if not files:
        raise SMPCheckpointError.build(
            "from_pretrained under smp.delay_param_initialization reads the safetensors "
            "weights of a local folder, and there are none", os.fspath(folder),
            where=f"{cls.__name__}.from_pretrained",
            fix="pass a folder save_pretrained wrote (model.safetensors or its index)")
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, (str, os.PathLike)):
        config = cls.config_class.from_pretrained(config or folder)
    with params_on_meta():
        model = cls._from_config(config, **{k: kwargs[k] for k in MODEL_KWARGS if k in kwargs})
    object.__setattr__(model, PRETRAINED_ATTR, tuple(files))
    return model.eval()


@contextmanager
def meta_from_pretrained() -> Iterator[None]:
    """Inside: ``PreTrainedModel.from_pretrained`` as the module docstring says (a no-op
    when transformers was never imported: then no model of it can be built inside)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        yield
        return
    base = transformers.PreTrainedModel
    original = base.__dict__["from_pretrained"]
    base.from_pretrained = classmethod(_from_pretrained)
    try:
        yield
    finally:
        base.from_pretrained = original
