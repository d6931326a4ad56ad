"""State of the wrapped module that no stage reads, kept by the first pipeline stage.

A model may register persistent state its forward never touches: transformers 4.2x's
GPT-2 keeps a ``masked_bias`` buffer per attention layer, unused since its attention
stopped reading it. No traced node reads such a tensor, so no stage holds it; yet
``state_dict()`` must be exactly the plain model's, and ``load_state_dict`` must accept
it. The rank of stage 0 keeps it, as the module holds it (never moved, never trained):
its name joins that rank's local tensors, so it is saved, merged and loaded like any
other.
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
