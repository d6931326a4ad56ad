"""The weights ``save_pretrained`` writes (safetensors, sharded or not), read as one state
dict; safe whatever their origin, since safetensors holds tensors only.
"""

from __future__ import annotations

import json
import os
from typing import Any

from cost_model.errors import SMPCheckpointError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def find_hf_weights(folder: str) -> list[str]:
    """The safetensors weight files of a ``save_pretrained`` folder ([] when there are none)."""
    single = os.path.join(folder, SAFE_WEIGHTS)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(folder, SAFE_INDEX)
    if not os.path.isfile(index):
        return []
    with open(index, encoding="utf-8") as fh:
        weight_map = json.load(fh).get("weight_map", {})
    return [os.path.join(folder, f) for f in sorted(set(weight_map.values()))]


def read_hf_weights(files: list[str]) -> dict[str, Any]:
    """The tensors of every file, by name (a name in two files is an error)."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise SMPCheckpointError.build(
            "reading .safetensors weights needs the safetensors package", files[0],
            fix="pip install safetensors (transformers installs it)") from exc
    state: dict[str, Any] = {}
    for file in files:
        for name, tensor in load_file(file, device="cpu").items():
            if name in state:
                raise SMPCheckpointError.build("a tensor appears in two weight files", name,
                                               where=file, fix="use the folder's own index")
            state[name] = tensor
    return state
