"""Which input dimensions a captured graph leaves free, and the check against new inputs.

Export keeps a dimension symbolic where the model allows (batch, sequence), so one graph
serves every shape it admits, and a shape it does not admit is named before anything runs.

>>> dims = InputDims((DimsOf("x", (Free("s0", 2, None), Fixed(8))),))
>>> dims.check_shapes({"x": (4, 8)})
>>> try:
...     dims.check_shapes({"x": (4, 9)})
... except SMPRuntimeError as exc:
...     print(str(exc).split(". Fix")[0].split(") at ")[1])
input 'x' dimension 1
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from cost_model.errors import SMPRuntimeError


@dataclass(frozen=True)
class Fixed:
    """A dimension the graph was specialised to."""

    size: int


@dataclass(frozen=True)
class Free:
    """A symbolic dimension: any size in ``[lo, hi]`` (``hi`` None: unbounded); dimensions
    sharing ``symbol`` must be equal."""

    symbol: str
    lo: int
    hi: int | None


Dim = Fixed | Free


@dataclass(frozen=True)
class DimsOf:
    """One tensor input of the graph (``name``: its placeholder) and its dimensions."""

    name: str
    dims: tuple[Dim, ...]


@dataclass(frozen=True)
class InputDims:
    """The dimensions of every tensor input, in placeholder order; ``inputs`` None: every
    dimension is free (an fx graph)."""

    inputs: tuple[DimsOf, ...] | None

    @classmethod
    def free(cls) -> InputDims:
        return cls(None)

    @property
    def any_fixed(self) -> bool:
        return self.inputs is not None and any(
            isinstance(d, Fixed) for i in self.inputs for d in i.dims)

    def free_words(self) -> str:
        """The symbolic dimensions in words, ``"input_ids[0, 1]"`` per input that has any:
        what one graph serves, and what the capture paid for (each symbolic dimension
        costs torch.export symbolic reasoning: Swin's image height and width most)."""
        if self.inputs is None:
            return "every dimension (an fx graph)"
        words = []
        for inp in self.inputs:
            free = [str(k) for k, d in enumerate(inp.dims) if isinstance(d, Free)]
            if free:
                words.append(f"{inp.name}[{', '.join(free)}]")
        return ", ".join(words) or "none"

    def check_shapes(self, shapes: Mapping[str, tuple[int, ...] | None]) -> None:
        """Raise naming the first input and dimension the graph cannot take; ``shapes``
        maps placeholder names to the new tensors' shapes (None: not a tensor)."""
        if self.inputs is None:
            return
        bound: dict[str, tuple[int, str, int]] = {}
        for inp in self.inputs:
            shape = shapes.get(inp.name)
            if shape is None:
                continue
            if len(shape) != len(inp.dims):
                raise _error(inp.name, None, f"{len(shape)} dimensions",
                             f"the graph was captured with {len(inp.dims)}")
            for i, (size, dim) in enumerate(zip(shape, inp.dims)):
                if isinstance(dim, Fixed):
                    if size != dim.size:
                        raise _error(inp.name, i, size,
                                     f"torch.export fixed it to {dim.size} (the model needs "
                                     "that size, or the example had it)")
                    continue
                if size < dim.lo or (dim.hi is not None and size > dim.hi):
                    hi = "inf" if dim.hi is None else dim.hi
                    raise _error(inp.name, i, size, f"the graph admits [{dim.lo}, {hi}]")
                seen = bound.setdefault(dim.symbol, (size, inp.name, i))
                if seen[0] != size:
                    raise _error(inp.name, i, size,
                                 f"torch.export found it equal to input '{seen[1]}' "
                                 f"dimension {seen[2]} (size {seen[0]} here)")

    def check(self, gm_or_spec: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """``check_shapes`` on a call's ``args``/``kwargs`` bound to the graph's inputs."""
        if self.inputs is None:
            return
        self.check_shapes(shapes_by_placeholder(gm_or_spec, args, kwargs))


def _error(name: str, dim: int | None, value: Any, why: str) -> SMPRuntimeError:
    where = f"input '{name}'" + ("" if dim is None else f" dimension {dim}")
    return SMPRuntimeError.build(
        f"the partitioned graph cannot take this shape: {why}", value, where,
        "keep that dimension at the captured size (pad to it, or drop_last=True for a short "
        "last batch), or make the model's size handling traceable so torch.export keeps it "
        "symbolic")


def shapes_by_placeholder(spec_source: Any, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Placeholder name -> shape of the value a call binds to it (None for non-tensors).

    ``spec_source`` is a ``(placeholder names, in_spec)`` pair or a GraphModule with a
    pytree codegen (export graphs)."""
    if isinstance(spec_source, torch.fx.GraphModule):
        names = [n.name for n in spec_source.graph.nodes if n.op == "placeholder"]
        info = getattr(spec_source.graph._codegen, "pytree_info", None)
        in_spec = getattr(info, "in_spec", None)
    else:
        names, in_spec = spec_source
    if in_spec is None:
        return {}
    import torch.fx._pytree as fx_pytree

    flat = fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), in_spec)
    return {n: tuple(v.shape) if isinstance(v, torch.Tensor) else None
            for n, v in zip(names, flat)}


def input_dims_of(gm: torch.fx.GraphModule) -> InputDims:
    """Read the dimensions of an export graph's tensor inputs from its placeholders'
    ``val`` (fake tensors with symbolic sizes) and the symbols' ranges."""
    ranges = gm.meta.get("smp.range_constraints") or {}
    out: list[DimsOf] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        dims: list[Dim] = []
        for size in val.shape:
            if isinstance(size, int):
                dims.append(Fixed(size))
                continue
            expr = size.node.expr
            if expr.is_number:  # specialised while tracing
                dims.append(Fixed(int(expr)))
                continue
            lo, hi = ranges.get(str(expr), (0, None))
            dims.append(Free(str(expr), lo, hi))
        out.append(DimsOf(node.name, tuple(dims)))
    return InputDims(tuple(out))


def range_constraints(ep: Any) -> dict[str, tuple[int, int | None]]:
    """An ``ExportedProgram``'s symbol ranges as plain ints (None: unbounded)."""
    out: dict[str, tuple[int, int | None]] = {}
    for sym, vr in ep.range_constraints.items():
        out[str(sym)] = (_bound(vr.lower) or 0, _bound(vr.upper))
    return out


def _bound(value: Any) -> int | None:
    """A sympy range bound as an int; None for infinity."""
    try:
        return int(value)
    except (OverflowError, AttributeError, TypeError):  # torch's int_oo fails in sympy
        return None


def auto_dynamic_shapes(model: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``torch.export``'s ``dynamic_shapes`` asking for every dimension of every tensor
    input to be symbolic where the model allows (``Dim.AUTO``), keyed by argument name."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {i: torch.export.Dim.AUTO for i in range(v.dim())}
        return None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


__all__ = ["DimsOf", "Fixed", "Free", "InputDims", "auto_dynamic_shapes", "input_dims_of",
           "range_constraints", "shapes_by_placeholder"]
