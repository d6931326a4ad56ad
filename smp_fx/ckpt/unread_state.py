"""State of the wrapped module that no stage reads, kept by the first pipeline stage, so
``state_dict()`` stays exactly the plain model's (transformers 4.2x GPT-2's
``masked_bias``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def unread_state(module: nn.Module, stages: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """The persistent parameters and buffers of ``module`` (by state-dict name) that none
    of ``stages`` holds under any of their names (tied aliases count as held)."""
    held: set[str] = set()
    for stage in stages:
        held.update(stage.state_dict(keep_vars=True))
    by_tensor: dict[int, list[str]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            by_tensor.setdefault(id(value), []).append(name)
            tensors[name] = value
    out: dict[str, torch.Tensor] = {}
    for names in by_tensor.values():
        if not held.intersection(names):
            out[names[0]] = tensors[names[0]]
    return out
