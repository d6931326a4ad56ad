"""Straight-through steps: across processes a rank runs its ops on the calling thread, and
each step function there once its outputs are (before its backward decision is read, on
the last stage's rank).

What the forwards take from the step functions is learned in the function's first
(threaded) step: the grad mode and autocast of its ``model(...)`` calls, and, on a rank
whose stages take ``model(...)``'s arguments, where they come from (``ArgMap``: the
microbatch's own tensors, unchanged). ``ModeMemo`` keeps both; a later call that differs
is an error raised after the ops (``call_mismatch``, ``args_mismatch``).
See docs/runtime.md ('Threads') and docs/performance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cost_model.errors import SMPRuntimeError
from smp_fx.runtime.executor.modes import Autocast
from smp_fx.runtime.executor.turns import Microbatch

Modes = tuple[bool, Autocast]  # (grad enabled, autocast) of a model(...) call


Shape = Any  # a value's containers: None for a leaf, else (type, items)


def _flatten(x: Any, out: list[Any]) -> Shape:
    """Append ``x``'s leaves to ``out`` (plain tuples, lists and dicts opened); its shape.
    Not torch's pytree: a call is flattened per microbatch, and this is ~10x cheaper."""
    kind = type(x)
    if kind is tuple or kind is list:
        return (kind, tuple(_flatten(v, out) for v in x))
    if kind is dict:
        return (kind, tuple((k, _flatten(v, out)) for k, v in x.items()))
    out.append(x)
    return None


def _rebuild(shape: Shape, leaves: Iterator[Any]) -> Any:
    """The value of ``shape`` with the next leaves put back in."""
    if shape is None:
        return next(leaves)
    kind, items = shape
    if kind is dict:
        return {k: _rebuild(sub, leaves) for k, sub in items}
    return kind(_rebuild(sub, leaves) for sub in items)


@dataclass(frozen=True)
class Pieces:
    """A microbatch's leaves, and each one's in-place version counter as its step began
    (-1: not a tensor)."""

    leaves: list[Any]
    versions: list[int]

    @staticmethod
    def of(microbatch: Microbatch) -> Pieces:
        leaves: list[Any] = []
        _flatten(microbatch, leaves)
        return Pieces(leaves, [t._version if isinstance(t, torch.Tensor) else -1
                               for t in leaves])

    def unchanged(self, j: int, t: torch.Tensor) -> bool:
        """Whether ``t`` is leaf ``j`` itself, not changed in place since the step began."""
        return t is self.leaves[j] and t._version == self.versions[j]


@dataclass(frozen=True)
class ArgMap:
    """How a ``model(...)`` call's ``(args, kwargs)`` came from its step function's
    microbatch: each tensor is one of the microbatch's own (its position among the
    microbatch's leaves), not changed in place before the call; any other leaf a constant.
    Lets the first stage's rank run its forwards before its step functions, checked at
    each late call (``matches``). Buys, 1F1B p = 2 first rank (step_counts.py, smp-fx /
    torch): step-function threads 0.7-1.1 ms -> none, voluntary switches 53-59 / 37-39
    -> 33-41 / 38-43, its own work +1.4-2.1 -> +1.0-1.1 ms over torch's."""

    shape: Shape
    sources: tuple[int | None, ...]  # per call leaf: the microbatch leaf; None: a constant
    constants: tuple[Any, ...]

    @staticmethod
    def learn(call: Microbatch, pieces: Pieces) -> ArgMap | None:
        """The map of a threaded step's call; None where a tensor is not the microbatch's
        own as it was when the step began (a cast, a device move, an in-place change)."""
        leaves: list[Any] = []
        shape = _flatten(call, leaves)
        own = {id(t): i for i, t in enumerate(pieces.leaves) if isinstance(t, torch.Tensor)}
        sources: list[int | None] = []
        for leaf in leaves:
            j = own.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if isinstance(leaf, torch.Tensor) and (j is None or not pieces.unchanged(j, leaf)):
                return None
            sources.append(j)
        return ArgMap(shape, tuple(sources),
                      tuple(None if j is not None else x for j, x in zip(sources, leaves)))

    def build(self, pieces: Pieces) -> Microbatch:
        """The call's ``(args, kwargs)`` from this microbatch's pieces."""
        own = pieces.leaves
        return _rebuild(self.shape, iter([own[j] if j is not None else c
                                          for j, c in zip(self.sources, self.constants)]))

    def matches(self, call: Microbatch, pieces: Pieces) -> bool:
        """Whether a late call passed what ``build`` gave the forwards, unchanged since."""
        leaves: list[Any] = []
        if _flatten(call, leaves) != self.shape:
            return False
        for leaf, j, c in zip(leaves, self.sources, self.constants):
            if j is None:
                if isinstance(leaf, torch.Tensor) or not _same(leaf, c):
                    return False
            elif not pieces.unchanged(j, leaf):
                return False
        return True

    def agree(self, other: ArgMap | None) -> bool:
        """Whether two microbatches' maps are the same (one map serves every microbatch)."""
        return (other is not None and self.shape == other.shape
                and self.sources == other.sources
                and all(_same(a, b) for a, b in zip(self.constants, other.constants)))


def _same(a: Any, b: Any) -> bool:
    """Equal constants of a call (an ``==`` that does not give a bool is not equal)."""
    try:
        return type(a) is type(b) and bool(a == b) is True
    except Exception:
        return False


Learned = tuple[Modes, ArgMap | None]  # what a straight step's forwards take


class ModeMemo:
    """Per step function and launch modes: what its first (threaded) step's ``model(...)``
    calls showed, if every microbatch's agreed: their modes and, where learned, their
    ``ArgMap``. A straight step's forwards take them; a call that differs is an error."""

    LIMIT = 16  # step functions remembered (a script has a few)

    def __init__(self) -> None:
        self._seen: dict[tuple[Callable[..., Any], Modes], Learned | None] = {}

    def get(self, fn: Callable[..., Any], launch: Modes) -> Learned | None:
        """What to run straight with; None: run threaded (not learned, or disagreed)."""
        return self._seen.get((fn, launch))

    def known(self, fn: Callable[..., Any], launch: Modes) -> bool:
        return (fn, launch) in self._seen

    def learn(self, fn: Callable[..., Any], launch: Modes, calls: Sequence[Modes | None],
              maps: Sequence[ArgMap | None] = ()) -> None:
        """Remember a threaded step's calls (None: a microbatch made none) and their maps
        (none given: the rank's stages take no arguments)."""
        if len(self._seen) >= self.LIMIT:
            self._seen.pop(next(iter(self._seen)))
        modes = calls[0] if calls and all(c == calls[0] for c in calls) else None
        first = maps[0] if maps else None
        same = first is not None and all(first.agree(m) for m in maps[1:])
        self._seen[(fn, launch)] = None if modes is None else (modes, first if same else None)

    def forget(self, fn: Callable[..., Any], launch: Modes) -> None:
        """Learn again from the next (threaded) step: a call strayed from its map."""
        self._seen.pop((fn, launch), None)


def call_mismatch(mb: int, rank: int, want: Modes, got: Modes) -> SMPRuntimeError:
    """A straight step's ``model(...)`` call under other modes than its forwards took."""
    return SMPRuntimeError.build(
        "a step function must call model(...) under the same torch.no_grad/autocast in "
        "every step (this rank runs its forwards before the step function, with the modes "
        "its first step used)", f"grad enabled {got[0]}, autocast {list(got[1])}; the "
        f"forwards ran with grad enabled {want[0]}, autocast {list(want[1])}",
        f"rank {rank} microbatch {mb}",
        "set torch.no_grad()/autocast the same way in every call of this step function, "
        "or around the smp.step call, or use another step function for the other mode")


def args_mismatch(mb: int, rank: int) -> SMPRuntimeError:
    """A straight step's ``model(...)`` call with other values than its forwards took."""
    return SMPRuntimeError.build(
        "on the first stage's rank a step function must call model(...) with its "
        "microbatch's own tensors, unchanged, as in its first step (this rank ran its "
        "forwards with them before the step function)", "other tensors or arguments, or a "
        "tensor changed in place before the call", f"rank {rank} microbatch {mb}",
        "make the call the same way in every step; the next step runs this step function "
        "threaded and learns its call again")


def not_called(mb: int, rank: int) -> SMPRuntimeError:
    """A straight step's step function returned without calling the model."""
    return SMPRuntimeError.build(
        "the smp.step function returned without calling the DistributedModel",
        f"microbatch {mb}", f"rank {rank}", "call model(...) inside every smp.step function")


__all__ = ["ArgMap", "Learned", "ModeMemo", "Modes", "Pieces", "args_mismatch",
           "call_mismatch", "not_called"]
