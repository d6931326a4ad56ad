"""Splitting an ``smp.step`` call's arguments into microbatches, as SMP splits them.

The one splitter: ``smp-fx partition`` plans on its first microbatch, so the offline plan
is made on the inputs the runtime traces.

>>> import torch
>>> mbs = split_inputs((torch.arange(4), {"y": [torch.zeros(4, 2)]}, "tag"), {}, 2)
>>> [a[0].tolist() for a, _ in mbs], mbs[1][0][1]["y"][0].shape, mbs[1][0][2]
([[0, 1], [2, 3]], torch.Size([2, 2]), 'tag')
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from cost_model.errors import SMPRuntimeError

Microbatch = tuple[tuple[Any, ...], dict[str, Any]]


def split_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any], num_mb: int,
                 non_split_inputs: Sequence[str] = (), input_split_axes: Mapping[str, int]
                 | None = None, fn: Callable[..., Any] | None = None) -> list[Microbatch]:
    """Return ``num_mb`` ``(args, kwargs)`` pairs; names for the split options are ``fn``'s
    parameter names."""
    axes = input_split_axes or {}
    names = _positional_names(fn, len(args))
    # each value is cut into all its pieces at once (one ``split`` call per tensor)
    pieces = [[value] * num_mb if name in non_split_inputs else
              _pieces(value, num_mb, axes.get(name, 0), name)
              for name, value in zip(names, args)]
    kw = {name: [value] * num_mb if name in non_split_inputs else
          _pieces(value, num_mb, axes.get(name, 0), name) for name, value in kwargs.items()}
    return [(tuple(p[mb] for p in pieces), {k: p[mb] for k, p in kw.items()})
            for mb in range(num_mb)]


@functools.lru_cache(maxsize=64)
def _signature_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """Positional parameter names of ``fn`` (cached: inspect.signature is slow per step)."""
    names: list[str] = []
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            break
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return tuple(names)


def _positional_names(fn: Callable[..., Any] | None, n: int) -> list[str]:
    names: list[str] = list(_signature_names(fn)) if fn is not None else []
    names += [f"arg{i}" for i in range(len(names), n)]
    return names[:n]


_WHOLE = frozenset((type(None), bool, int, float, str))  # passed whole without a look


def _pieces(value: Any, num_mb: int, axis: int, where: str) -> list[Any]:
    """``value`` cut into ``num_mb`` microbatch pieces (or passed whole to each)."""
    t = type(value)
    if t in _WHOLE:
        return [value] * num_mb
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return [value] * num_mb
        size = value.shape[axis]
        if size % num_mb:
            raise SMPRuntimeError.build(
                "the batch size of every split input must be divisible by microbatches",
                f"size {size} along axis {axis} for {num_mb} microbatches",
                f"smp.step argument '{where}'",
                "use drop_last=True in the DataLoader, skip the last batch, or list the "
                "argument in non_split_inputs")
        if size == 0:  # split() refuses a zero split size
            return [value] * num_mb
        return list(value.split(size // num_mb, axis))
    # a module's attributes live in its __dict__ or class: nn.Module.__getattr__ (which
    # hasattr would run, and which raises) only looks at parameters, buffers and submodules
    if isinstance(value, torch.nn.Module):
        sliced = "smp_slice" in value.__dict__ or hasattr(t, "smp_slice")
    else:
        sliced = hasattr(value, "smp_slice")
    if sliced:
        return [value.smp_slice(num_mb, mb, axis) for mb in range(num_mb)]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        parts = [_pieces(v, num_mb, axis, where) for v in value]
        return [t(*(p[mb] for p in parts)) for mb in range(num_mb)]
    if isinstance(value, (list, tuple)):
        parts = [_pieces(v, num_mb, axis, where) for v in value]
        return [t(p[mb] for p in parts) for mb in range(num_mb)]
    if isinstance(value, dict):
        items = [(k, _pieces(v, num_mb, axis, f"{where}[{k!r}]")) for k, v in value.items()]
        return [t((k, p[mb]) for k, p in items) for mb in range(num_mb)]
    return [value] * num_mb
