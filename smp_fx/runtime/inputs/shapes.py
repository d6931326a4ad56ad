"""Varying batch sizes and sequence lengths on a pipeline partitioned once.

``ShapeGuard`` checks each new call signature against the graph's input dimensions and,
across processes, the shapes each stage receives. See docs/runtime.md, 'A step's inputs'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from cost_model.errors import SMPRuntimeError
from passes import meta
from passes.input_dims import Free, InputDims, shapes_by_placeholder
from passes.split_stages import StagedProgram

Signature = tuple[Any, ...]


def signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Signature:
    """The shapes (and dtypes) of a call's tensors, in pytree order: equal signatures bind
    the same sizes to every symbolic dimension."""
    leaves = pytree.tree_leaves((args, kwargs))
    return tuple((tuple(x.shape), x.dtype) for x in leaves if isinstance(x, torch.Tensor))


class ShapeGuard:
    """See the module docstring; one per partitioned ``DistributedModel``."""

    def __init__(self, dims: InputDims, program: StagedProgram) -> None:
        self.dims = dims
        self.program = program
        self._names = tuple(n for n, _, _ in program.placeholders)
        self._seen: set[Signature] = set()
        # signature -> stage -> received value name -> expected shape (None: unchecked)
        self._expected: dict[Signature, dict[int, dict[str, Any]]] = {}

    @property
    def active(self) -> bool:
        """Whether any check can fail (an fx graph takes every shape)."""
        return self.dims.inputs is not None

    def check_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.active:
            return
        sig = signature(args, kwargs)
        if sig in self._seen:
            return
        self.dims.check_shapes(self._shapes(args, kwargs))
        self._seen.add(sig)

    def _shapes(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> dict[str, tuple[int, ...] | None]:
        return shapes_by_placeholder((self._names, self.program.in_spec), args, kwargs)

    def _bindings(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> dict[str, tuple[int, str, int]]:
        """symbol -> (size, input name, dimension) from this rank's call."""
        shapes = self._shapes(args, kwargs)
        out: dict[str, tuple[int, str, int]] = {}
        for inp in self.dims.inputs or ():
            shape = shapes.get(inp.name)
            if shape is None:
                continue
            for i, (size, dim) in enumerate(zip(shape, inp.dims)):
                if isinstance(dim, Free):
                    out.setdefault(dim.symbol, (size, inp.name, i))
        return out

    def check_received(self, stage: int, received: Mapping[str, Any], rank: int,
                       args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise if a value ``stage`` received has a shape this rank's call does not give."""
        if not self.active:
            return
        sig = signature(args, kwargs)
        per_stage = self._expected.setdefault(sig, {})
        if stage not in per_stage:
            per_stage[stage] = self._expect(stage, self._bindings(args, kwargs))
        for name, want in per_stage[stage].items():
            got = received.get(name)
            if want is None or not isinstance(got, torch.Tensor):
                continue
            shape, exprs, symbolic = want
            if got.dim() != len(shape) or any(got.shape[i] != shape[i] for i in symbolic):
                raise self._disagree(name, tuple(got.shape), shape, exprs, rank, args, kwargs)

    def _expect(self, stage: int, bindings: dict[str, tuple[int, str, int]]
                ) -> dict[str, Any]:
        """Received value name -> (expected shape, symbolic expression per dimension,
        the symbolic dims' indices); None: unchecked."""
        st = self.program.stages[stage]
        received = {n for _, names in st.recvs for n in names}
        values = {s: v[0] for s, v in bindings.items()}
        out: dict[str, Any] = {}
        for node in st.module.graph.nodes:
            if node.op != "placeholder" or node.name not in received:
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or meta.TP_GATHERED.get(node, False):
                out[node.name] = None
                continue
            shape, exprs = _evaluate(val.shape, values)
            split = meta.TP_SPLIT.get(node)
            split = None if split is None else split % val.dim()
            local = meta.CP_LOCAL.get(node) or ()  # this rank's tokens: 1/cp of the whole
            symbolic = tuple(i for i, d in enumerate(val.shape)
                             if not isinstance(d, int) and i != split and i not in local)
            out[node.name] = None if shape is None else (shape, exprs, symbolic)
        return out

    def _disagree(self, name: str, got: tuple[int, ...], want: tuple[int, ...],
                  exprs: tuple[str, ...], rank: int, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> SMPRuntimeError:
        bindings = self._bindings(args, kwargs)
        culprit = ""
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w and exprs[i] in bindings:
                size, inp, dim = bindings[exprs[i]]
                culprit = (f"input '{inp}' dimension {dim}: {size} on this rank, {g} on the "
                           "sending rank")
                break
        return SMPRuntimeError.build(
            "the ranks of a pipeline ran this step on inputs of different shapes",
            culprit or f"received {name!r} of shape {got}, this rank's inputs give {want}",
            f"rank {rank}, stage input {name!r}",
            "give every rank of a pipeline the same batch (same batch size and sequence "
            "length); only data-parallel replicas may differ")


def _evaluate(shape: Sequence[Any], values: dict[str, int]
              ) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """A symbolic shape's sizes under ``values`` (None if a symbol is unbound)."""
    sizes: list[int] = []
    exprs: list[str] = []
    for s in shape:
        if isinstance(s, int):
            sizes.append(s)
            exprs.append(str(s))
            continue
        expr = s.node.expr
        exprs.append(str(expr))
        subs = {sym: values[str(sym)] for sym in expr.free_symbols if str(sym) in values}
        if len(subs) != len(expr.free_symbols):
            return None, ()
        sizes.append(int(expr.xreplace(subs)))
    return tuple(sizes), tuple(exprs)


def guard_for(gm: torch.fx.GraphModule, program: StagedProgram) -> ShapeGuard:
    """The guard for a planned graph (``gm.meta["smp.input_dims"]``, set by the front end)."""
    return ShapeGuard(gm.meta.get("smp.input_dims") or InputDims.free(), program)


__all__ = ["ShapeGuard", "guard_for", "signature"]
