"""Model outputs that torch's pytree does not know, captured anyway and rebuilt as returned.

transformers 4.2x does not register ``ModelOutput`` with torch's pytree, so export fails.
Rather than register another library's classes globally, the capture wraps them in our
own registered ``RebuiltOutput``, which unflattens to the model's own class. A Hugging
Face cache object is left out with a warning. See docs/architecture.md, 'The captured graph'.

>>> from collections import OrderedDict
>>> import torch
>>> class Out(OrderedDict):
...     pass
>>> wrapped = wrap_unknown_outputs((Out(a=torch.ones(1)), torch.zeros(1)))
>>> leaves, spec = pytree.tree_flatten(wrapped)
>>> rebuilt = pytree.tree_unflatten(leaves, spec)
>>> type(rebuilt[0]).__name__, list(rebuilt[0])
('Out', ['a'])
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch.utils._pytree as pytree
from torch import nn


class RebuiltOutput:
    """A mapping output of an unregistered class, held for flattening (module doc)."""

    __slots__ = ("cls", "keys", "values")

    def __init__(self, cls: type, keys: tuple[Any, ...], values: tuple[Any, ...]) -> None:
        self.cls = cls
        self.keys = keys
        self.values = values


def _flatten(node: RebuiltOutput) -> tuple[list[Any], Any]:
    return list(node.values), (node.cls, node.keys)


def _unflatten(values: Any, context: Any) -> Any:
    cls, keys = context
    fields = dict(zip(keys, values))
    build: Callable[..., Any] = cls
    return build(**fields) if dataclasses.is_dataclass(cls) else build(fields)


pytree.register_pytree_node(RebuiltOutput, _flatten, _unflatten)
log = logging.getLogger("smp_fx.passes.trace")


def _unknown_mapping(value: Any) -> bool:
    return isinstance(value, Mapping) and type(value) not in pytree.SUPPORTED_NODES


def wrap_unknown_outputs(value: Any) -> Any:
    """``value`` with every mapping of an unregistered type wrapped in ``RebuiltOutput``,
    nested ones too (inside tuples, lists, dicts and the wrapped mappings' values)."""
    if _unknown_mapping(value):
        return RebuiltOutput(type(value), tuple(value.keys()),
                             tuple(wrap_unknown_outputs(v) for v in value.values()))
    t = type(value)
    if t is tuple or t is list:
        return t(wrap_unknown_outputs(v) for v in value)
    if t is dict:
        return {k: wrap_unknown_outputs(v) for k, v in value.items()}
    return value


def has_unknown_outputs(value: Any) -> bool:
    """Whether ``wrap_unknown_outputs`` would wrap anything in ``value``."""
    if _unknown_mapping(value):
        return True
    if type(value) in (tuple, list):
        return any(has_unknown_outputs(v) for v in value)
    if type(value) is dict:
        return any(has_unknown_outputs(v) for v in value.values())
    return False


def is_hf_cache(value: Any) -> bool:
    """A Hugging Face ``Cache`` (``DynamicCache``, ``EncoderDecoderCache``, ...), known by
    its class's bases (transformers is not imported)."""
    return any(c.__name__ == "Cache" and c.__module__ == "transformers.cache_utils"
               for c in type(value).__mro__)


def drop_caches(value: Any, found: list[str]) -> Any:
    """``value`` with every Hugging Face cache object in it left out (a mapping's entry
    removed, a tuple's or list's position None); their class names go to ``found``."""
    if is_hf_cache(value):
        found.append(type(value).__name__)
        return None
    if isinstance(value, Mapping):
        kept = {k: drop_caches(v, found) for k, v in value.items()}
        if not any(is_hf_cache(v) for v in value.values()) and \
                all(kept[k] is v for k, v in value.items()):
            return value
        kept = {k: v for k, v in kept.items() if v is not None or value[k] is None}
        build: Callable[..., Any] = type(value)
        return build(**kept) if dataclasses.is_dataclass(value) else build(kept)
    if type(value) in (tuple, list):
        items = [drop_caches(v, found) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else type(value)(items)
    return value


def capture_outputs(model: nn.Module) -> Callable[[], None]:
    """While capturing ``model``: a forward hook leaving out Hugging Face cache objects (no
    tensor export can return; logged) and wrapping unregistered outputs; returns its
    remover. The model itself is not changed."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        found: list[str] = []
        kept = drop_caches(output, found)
        if found:
            log.warning("%s returned %s (use_cache=True): left out of the captured outputs, "
                        "which training does not read; pass use_cache=False not to build it",
                        type(module).__name__, ", ".join(sorted(set(found))))
        if has_unknown_outputs(kept):
            return wrap_unknown_outputs(kept)
        return kept if found else None

    handle = model.register_forward_hook(hook)
    return handle.remove
