"""Splitting an ``smp.step`` call's arguments into microbatches.

SMP splits every tensor argument along its batch axis (0 unless ``input_split_axes`` says
otherwise), including tensors nested in lists, tuples and dicts; an object with an
``smp_slice(num_mb, mb, axis)`` method slices itself; any other object is passed whole to
every microbatch, as are the arguments named in ``non_split_inputs``.

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
    """Return ``num_mb`` ``(args, kwargs)`` pairs, microbatch ``i`` holding slice ``i``.

    Argument names (for ``non_split_inputs`` / ``input_split_axes``) are the parameter names
    of ``fn``'s signature; keyword arguments are matched by their own names.
    """
    axes = dict(input_split_axes or {})
    names = _positional_names(fn, len(args))
    out_args: list[list[Any]] = [[] for _ in range(num_mb)]
    out_kwargs: list[dict[str, Any]] = [{} for _ in range(num_mb)]
    for positional, (name, value) in [(True, nv) for nv in zip(names, args)] + \
            [(False, nv) for nv in kwargs.items()]:
        for mb in range(num_mb):
            piece = value if name in non_split_inputs else \
                _slice(value, num_mb, mb, axes.get(name, 0), name)
            if positional:
                out_args[mb].append(piece)
            else:
                out_kwargs[mb][name] = piece
    return [(tuple(a), k) for a, k in zip(out_args, out_kwargs)]


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


def _slice(value: Any, num_mb: int, mb: int, axis: int, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        size = value.shape[axis]
        if size % num_mb:
            raise SMPRuntimeError.build(
                "the batch size of every split input must be divisible by microbatches",
                f"size {size} along axis {axis} for {num_mb} microbatches",
                f"smp.step argument '{where}'",
                "use drop_last=True in the DataLoader, skip the last batch, or list the "
                "argument in non_split_inputs")
        step = size // num_mb
        return value.narrow(axis, mb * step, step)
    if hasattr(value, "smp_slice"):
        return value.smp_slice(num_mb, mb, axis)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_slice(v, num_mb, mb, axis, where) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_slice(v, num_mb, mb, axis, where) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _slice(v, num_mb, mb, axis, f"{where}[{k!r}]"))
                           for k, v in value.items())
    return value
