"""Reading one checkpoint file: ``torch.load`` with the safe loader unless told otherwise.

One place for the rule, since ``smp.load`` and ``smp.resume_from_checkpoint`` both read
through it. See docs/checkpoints.md, 'Files, crash safety and formats'.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import pickle
import sys
from typing import Any

import torch

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt.layout import partial_path
from smp_fx.ckpt.validate import load_error

log = logging.getLogger("smp_fx.ckpt")


def _numpy_safe_globals() -> list[Any]:
    """The numpy names arrays and scalars are pickled with, under both spellings (``numpy.core``
    1.x, ``numpy._core`` 2.x), allowed as the Trainer allows them for RNG states."""
    import numpy as np

    # numpy 2 keeps multiarray in np._core; numpy 1.26 has a np._core without it
    core: Any = next(m for m in (getattr(np, "_core", None), getattr(np, "core", None))
                     if hasattr(m, "multiarray"))
    kinds = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
             np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
             np.complex128)
    both = [(getattr(core.multiarray, f), f"numpy.{pkg}.multiarray.{f}")
            for f in ("_reconstruct", "scalar") for pkg in ("core", "_core")]
    return [*both, np.ndarray, np.dtype, *(type(np.dtype(k)) for k in kinds)]


TRUST_ENV = "SMP_FX_TRUST_CHECKPOINTS"
"""``1``: read checkpoints with the unsafe loader where no ``weights_only`` is given."""


def trusted_class(name: str) -> type | None:
    """The class a checkpoint global names, if it is on the allowlist (module docstring):
    ``argparse.Namespace`` or a configuration class of ``transformers`` or of its
    dynamic-module cache. Nothing else is imported."""
    if name == "argparse.Namespace":
        return argparse.Namespace
    module, _, attr = name.rpartition(".")
    top = module.partition(".")[0]
    if top not in ("transformers", DYNAMIC):
        return None
    try:
        found = importlib.import_module(module) if top == "transformers" \
            else _from_dynamic_cache(module)
        cls = getattr(found, attr)
        from transformers import PretrainedConfig
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, PretrainedConfig) else None


DYNAMIC = "transformers_modules"
"""The package of Hugging Face's dynamic-module cache: the code ``trust_remote_code``
fetched (Falcon's configuration class, saved in its ``user_content``)."""


def _from_dynamic_cache(module: str) -> Any:
    """``module`` (under ``transformers_modules``), imported only if it and every package
    above it are files of Hugging Face's dynamic-module cache; else ``ImportError``."""
    from transformers import dynamic_module_utils as dyn

    dyn.init_hf_modules()  # the cache on sys.path, as from_pretrained(trust_remote_code)
    cache = os.path.realpath(dyn.HF_MODULES_CACHE)
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name)
        spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec(name)
        origin = getattr(spec, "origin", None) or ""
        locations = list(getattr(spec, "submodule_search_locations", None) or [origin])
        if not all(os.path.realpath(p).startswith(cache + os.sep) for p in locations if p) \
                or not any(locations):
            raise ImportError(f"{name} is not a file of {cache}")
        importlib.import_module(name)
    return sys.modules[module]


def _allowed_globals(path: str) -> list[Any]:
    """The allowlisted classes among the globals of the checkpoint at ``path`` (the
    others stay refused by the safe loader, which names them)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a readable zip: torch.load says what is wrong
        return []
    return [cls for cls in map(trusted_class, names) if cls is not None]


def resolve_weights_only(weights_only: bool | None, pickle_module: Any) -> bool:
    """``weights_only`` as given, else safe unless a custom ``pickle_module`` was asked for
    (its own unpickler is what the caller wants, and the safe loader has its own) or the
    environment trusts checkpoints (``SMP_FX_TRUST_CHECKPOINTS=1``)."""
    if weights_only is not None:
        return weights_only
    if os.environ.get(TRUST_ENV) == "1":
        return False
    return pickle_module is None or pickle_module is pickle


def read_file(path: str, map_location: Any = None, pickle_module: Any = pickle,
              weights_only: bool | None = None, **pickle_load_args: Any) -> Any:
    """``torch.load`` with the safe loader by default; a file it cannot read is an error
    that says what is wrong with the file (``validate.load_error``)."""
    if not os.path.exists(path):
        fix = "check the path (partial files end in _<mp_rank>)"
        if os.path.exists(partial_path(path, 0)):
            fix = f"{path} is a partial checkpoint: load it with partial=True"
        raise SMPCheckpointError.build("checkpoint file does not exist", path, fix=fix)
    safe = resolve_weights_only(weights_only, pickle_module)
    if safe and pickle_module is not pickle and pickle_module is not None:
        raise SMPCheckpointError.build(
            "a custom pickle_module cannot be used with weights_only=True",
            getattr(pickle_module, "__name__", pickle_module), where=path,
            fix="drop weights_only=True to use the module (only for files you trust)")
    try:
        if safe:
            allowed = [*_numpy_safe_globals(), *_allowed_globals(path)]
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True,
                                  **pickle_load_args)
        if weights_only is None and os.environ.get(TRUST_ENV) == "1":
            log.warning("%s=1: %s read with the unsafe loader (weights_only=False)",
                        TRUST_ENV, path)
        return torch.load(path, map_location=map_location, weights_only=False,
                          pickle_module=pickle_module or pickle, **pickle_load_args)
    except Exception as exc:
        raise load_error(path, exc, safe) from exc

