"""A full model state written as Hugging Face's ``save_pretrained`` writes it, so that
``from_pretrained`` loads it.

transformers itself writes the folder, handed the state with a tied tensor's names on one
object (how it recognises ties). See docs/checkpoints.md, 'Checkpoints Hugging Face loads'.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt.state_dict import PARTIAL_KEY, ModelLayout
from smp_fx.ckpt.tp_shards import TP_SHARDS_KEY
from smp_fx.world.state_api import module_manager


def is_pretrained(module: nn.Module) -> bool:
    """A Hugging Face model: it can write itself with ``save_pretrained``."""
    return callable(getattr(module, "save_pretrained", None)) and hasattr(module, "config")


def tie_aliases(state: Mapping[str, Any], layout: ModelLayout) -> dict[str, Any]:
    """``state`` with every name of a tied tensor holding the first present name's value."""
    out = {k: v for k, v in state.items() if k not in (PARTIAL_KEY, TP_SHARDS_KEY)}
    for group in layout.aliases:
        first = next((n for n in group if n in out), None)
        if first is not None:
            for name in group:
                if name in out:
                    out[name] = out[first]
    return out


def model_from_config(config_path: str) -> nn.Module:
    """The model a configuration describes (``config.json``, or the folder holding it),
    built on the meta device: for its class, configuration and ties, never its weights."""
    try:
        import transformers
    except ImportError as exc:
        raise SMPCheckpointError.build(
            "writing Hugging Face weights needs transformers", config_path,
            fix="pip install transformers") from exc
    config = transformers.AutoConfig.from_pretrained(config_path)
    names = list(getattr(config, "architectures", None) or [])
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise SMPCheckpointError.build(
            "the configuration names no model class of transformers", names or None,
            where=config_path, fix="use the config.json save_pretrained wrote for the model")
    with torch.device("meta"):
        return cls(config)


def safetensors_available() -> bool:
    """Whether the ``safetensors`` package is there (transformers installs it from 4.3x on;
    smp-fx imports it only when it writes or reads such files)."""
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return False
    return True


def save_pretrained_state(folder: str, state: Mapping[str, Any], model: nn.Module) -> None:
    """Write ``state`` (the full model state, by the model's names) into ``folder`` as
    ``model.save_pretrained`` does, in safetensors."""
    if not safetensors_available():
        raise SMPCheckpointError.build(
            "writing .safetensors weights needs the safetensors package", folder,
            fix="pip install safetensors (transformers installs it from 4.3x on)")
    tied = tie_aliases(state, ModelLayout.from_module(model))
    kwargs: dict[str, Any] = {"state_dict": tied}
    save: Any = model.save_pretrained
    if "safe_serialization" in inspect.signature(save).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.2x writes .bin otherwise
    os.makedirs(folder, exist_ok=True)
    with module_manager.suspended():  # ``state`` is in Hugging Face's names already
        save(folder, **kwargs)
