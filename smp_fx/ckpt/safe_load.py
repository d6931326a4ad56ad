"""Reading one checkpoint file: ``torch.load`` with the safe loader unless told otherwise.

Loading uses ``torch.load(weights_only=True)`` unless told otherwise: what SMP scripts
save (tensors, dicts, lists, tuples, numbers, strings, optimizer and LR-scheduler state
dicts, numpy arrays and scalars) loads safely; an object holding other Python classes needs
``smp.load(..., weights_only=False)``, for files you trust only. Passing a custom
``pickle_module`` asks for that module's unpickler, which the safe loader cannot use, so it
implies ``weights_only=False`` (trusted files only) unless ``weights_only=True`` is given.

One place for that rule, since ``smp.load`` and ``smp.resume_from_checkpoint`` both read
files through it.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt.layout import partial_path
from smp_fx.ckpt.validate import load_error


def _numpy_safe_globals() -> list[Any]:
    """The numpy names an array or scalar is pickled with (its reconstructor and dtypes):
    allowed by the safe loader, as the Hugging Face Trainer allows them for RNG states,
    since scripts save numpy metrics and RNG states beside their tensors."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    kinds = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
             np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
             np.complex128)
    return [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype,
            *(type(np.dtype(k)) for k in kinds)]


def resolve_weights_only(weights_only: bool | None, pickle_module: Any) -> bool:
    """``weights_only`` as given, else safe unless a custom ``pickle_module`` was asked for
    (its own unpickler is what the caller wants, and the safe loader has its own)."""
    if weights_only is not None:
        return weights_only
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
            with torch.serialization.safe_globals(_numpy_safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True,
                                  **pickle_load_args)
        return torch.load(path, map_location=map_location, weights_only=False,
                          pickle_module=pickle_module or pickle, **pickle_load_args)
    except Exception as exc:
        raise load_error(path, exc, safe) from exc

