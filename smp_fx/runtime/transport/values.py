"""The values a microbatch's step moves through the executor: placed, flattened, copied (the
last stage's outputs are copied so a step function may modify its own in place).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree


def to_device(value: Any, device: torch.device) -> Any:
    """``value``'s tensors on ``device`` (a plain tensor already there, the usual model
    input, skips the pytree walk)."""
    if type(value) is torch.Tensor and value.device == device:
        return value
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)


def leaves(value: Any) -> list[Any]:
    """``pytree.tree_leaves`` with fast paths for a tensor and a tuple of tensors."""
    if type(value) is torch.Tensor:
        return [value]
    if type(value) is tuple and all(type(v) is torch.Tensor for v in value):
        return list(value)
    return pytree.tree_leaves(value)


def _tensors_only(value: Any) -> bool:
    """Whether ``value`` is a tuple of plain tensors, a stage's usual outputs."""
    return type(value) is tuple and all(type(v) is torch.Tensor for v in value)


def _sent(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad)


def sent_copy(outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The last stage's outputs as other ranks get them: detached copies (same
    ``requires_grad``), immune to what the step function does to the originals.
    A tuple of tensors skips the pytree walk: 22 -> 5-7 us per forward of the last stage
    (docs/performance.md)."""
    if _tensors_only(outputs):
        return tuple(_sent(t) for t in outputs)
    return pytree.tree_map_only(torch.Tensor, _sent, outputs)


def user_copy(cut: Any) -> Any:
    """Received outputs as this rank's step function gets them: its own copies, which it may
    modify in place (a received tensor that requires grad is a leaf, which could not be)
    while the received values are relayed on unchanged (a tuple of tensors skips the pytree
    walk, as in ``sent_copy``)."""
    with torch.enable_grad():
        if _tensors_only(cut):
            return tuple(t.clone() for t in cut)
        return pytree.tree_map_only(torch.Tensor, torch.clone, cut)


__all__ = ["leaves", "sent_copy", "to_device", "user_copy"]
