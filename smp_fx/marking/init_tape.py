"""A delayed model's construction, recorded on meta and replayed per tensor as eagerly built.

Replay runs the ops writing the wanted tensors in order and, the first time, every other
random op on a scratch tensor, so each kept tensor draws the eager build's numbers; the
generator state before each random op is kept, so later replays run only their own ops.
Memory is the kept tensors plus one scratch. A tensor cut from a recorded one (a
tensor-parallel shard, ``cutting``) is rebuilt from its source. See docs/memory.md.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_aten = torch.ops.aten
_EMPTY = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
          _aten.new_empty_strided}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}
_SKIP_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")
"""``torch.nn.init`` functions that return a meta tensor untouched (their random draws
depend on the values drawn): recorded as one call each."""
_RECORDING: list[Tape] = []
_TAPES: dict[int, weakref.ref[Tape]] = {}  # storage address -> the tape that holds it
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Ref:
    """A tensor argument: a view of recorded storage ``sid``."""

    sid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Op:
    """One recorded call; ``fresh``: (output leaf, storage id) of storages it made; ``rng``:
    the generator state before a random op, kept where it differs from the one the previous
    random op left (a ``torch.manual_seed`` inside the build)."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    reads: frozenset[int]
    writes: frozenset[int]
    fresh: tuple[tuple[int, int], ...]
    random: bool
    rng: torch.Tensor | None = None  # the generator's state before it, when it was set


def _key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return None


class Tape:
    """The recorded construction: ops, storages and the generator states they drew from."""

    __smp_not_traced__ = True  # passes.trace_memo.NOT_TRACED: no forward reads it

    def __init__(self) -> None:
        self._last_rng: torch.Tensor | None = None
        self.ops: list[Op] = []
        self._sid: dict[int, int] = {}
        self._held: list[torch.UntypedStorage] = []  # keeps storage addresses unique
        self._consts: dict[int, torch.UntypedStorage] = {}
        self._unknown: set[int] = set()
        self.initialised: dict[int, bool] = {}
        self.cut: set[int] = set()
        """Storages made by ``cutting`` from recorded ones (replayed one at a time)."""
        self._states: list[torch.Tensor | None] = []  # generator state before ops[i]
        self._after: torch.Tensor | None = None  # the state after ops[:len(_states)]
        weakref.finalize(self, _forget, self._sid)

    def __deepcopy__(self, memo: dict[int, Any]) -> Tape:
        return self  # a copied model's new meta tensors are not in it: refused by name

    def __reduce__(self) -> tuple[Any, ...]:
        return (Tape, ())  # a pickled model's tensors are new: an empty record, refused

    def holds(self, t: torch.Tensor) -> bool:
        key = _key(t)
        return key is not None and key in self._sid

    def ref(self, t: torch.Tensor) -> Ref:
        return Ref(self._sid[_key(t)],  # type: ignore[index]
                   t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _new(self, t: torch.Tensor) -> int:
        key = _key(t)
        assert key is not None
        sid = len(self._held)
        self._held.append(t.untyped_storage())
        self._sid[key] = sid
        _TAPES[key] = weakref.ref(self)
        return sid

    def _arg(self, value: Any) -> Any:
        """A recorded argument: tensors become ``Ref``s (a storage first met here is a
        constant copied now, or, on meta, one this tape cannot rebuild)."""
        if not isinstance(value, torch.Tensor) or _key(value) is None:
            return value.detach().clone() if isinstance(value, torch.Tensor) else value
        if _key(value) not in self._sid:
            sid = self._new(value)
            if value.is_meta:
                self._unknown.add(sid)
            else:
                self._consts[sid] = value.untyped_storage().clone()
            self.initialised[sid] = True
        return self.ref(value)

    def rng_before(self) -> torch.Tensor | None:
        """The generator state now, if a random op would not find the one it expects."""
        state = torch.get_rng_state()
        if self._last_rng is not None and torch.equal(state, self._last_rng):
            return None
        self._last_rng = state
        return state

    def rng_after(self) -> None:
        """A random op ran: on the host it drew numbers, on meta none."""
        self._last_rng = torch.get_rng_state()

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               out: Any, rng: torch.Tensor | None = None, cut: bool = False) -> None:
        """Append ``func(*args, **kwargs) -> out`` (arguments already registered; ``rng``
        from ``rng_before``; ``cut``: its new storages are cut from recorded ones)."""
        rargs, rkwargs = tree_map(self._arg, (args, kwargs))
        reads = frozenset(r.sid for r in tree_flatten((rargs, rkwargs))[0]
                          if isinstance(r, Ref))
        writes = frozenset(self.ref(t).sid for t in _written(func, args, kwargs))
        fresh = []
        for i, leaf in enumerate(tree_flatten(out)[0]):
            if isinstance(leaf, torch.Tensor) and _key(leaf) is not None \
                    and _key(leaf) not in self._sid:
                sid = self._new(leaf)
                self.initialised[sid] = func.overloadpacket not in _EMPTY and \
                    all(self.initialised[r] for r in reads)
                fresh.append((i, sid))
                if cut:
                    self.cut.add(sid)
        for sid in writes:
            self.initialised[sid] = True
        random = torch.Tag.nondeterministic_seeded in func.tags
        self.ops.append(Op(func, rargs, rkwargs, reads, writes, tuple(fresh), random, rng))

    def call(self, func: Callable[..., Any], tensor: torch.Tensor, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> None:
        """Append ``func(tensor, *args, **kwargs)``, an initialisation that fills ``tensor``
        with random numbers (how many it draws may depend on their values)."""
        r = self._arg(tensor)
        self.initialised[r.sid] = True
        self.ops.append(Op(func, (r, *args), dict(kwargs), frozenset({r.sid}),
                           frozenset({r.sid}), (), True, self.rng_before()))

    def problem(self, t: torch.Tensor) -> str | None:
        """Why ``t`` cannot be rebuilt (None: it can)."""
        if not self.holds(t):
            return "it was made outside smp.delay_param_initialization"
        if not self.initialised[self.ref(t).sid]:
            return "its construction leaves it uninitialised (torch.empty, never written)"
        return None

    def is_cut(self, t: torch.Tensor) -> bool:
        return self.holds(t) and self.ref(t).sid in self.cut

    def replay(self, wanted: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors equal to ``wanted`` (tensors this tape holds) as an eager build with
        the same seed makes them; see the module docstring."""
        refs = [self.ref(t) for t in wanted]
        need = {r.sid for r in refs}
        keep = [False] * len(self.ops)
        for i in range(len(self.ops) - 1, -1, -1):
            op = self.ops[i]
            if (op.writes | {s for _, s in op.fresh}) & need:
                keep[i] = True
                need |= op.reads | op.writes
        unknown = need & self._unknown
        if unknown:
            raise LookupError(f"storages {sorted(unknown)[:5]} were made outside the tape")
        storages = {s: st for s, st in self._consts.items() if s in need}
        saved = torch.get_rng_state()
        known = len(self._states)
        states = list(self._states)
        try:
            with torch.no_grad():
                for i, (op, kept) in enumerate(zip(self.ops, keep)):
                    if i < known:  # the generator state this op drew from is known
                        state = self._states[i]
                        if kept and state is not None:
                            torch.set_rng_state(state)
                        if kept:
                            _run(op, storages, scratch=False)
                        continue
                    if i == known and self._after is not None:
                        torch.set_rng_state(self._after)
                    if op.rng is not None:
                        torch.set_rng_state(op.rng)
                    states.append(torch.get_rng_state() if op.random else None)
                    if kept:
                        _run(op, storages, scratch=False)
                    elif op.random:
                        _run(op, storages, scratch=True)
                if len(states) > known:
                    self._states, self._after = states, torch.get_rng_state()
        finally:
            torch.set_rng_state(saved)
        return [_view(storages[r.sid], r) for r in refs]


def _forget(keys: dict[int, int]) -> None:
    for key in list(keys):
        ref = _TAPES.get(key)
        if ref is not None and ref() is None:
            del _TAPES[key]


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> Iterator[torch.Tensor]:
    """The tensors ``func`` writes in place (its schema's mutable arguments)."""
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                yield t


def _view(storage: torch.UntypedStorage, r: Ref) -> torch.Tensor:
    return torch.empty(0, dtype=r.dtype, device=_CPU).set_(storage, r.offset, r.size, r.stride)


def _run(op: Op, storages: dict[int, torch.UntypedStorage], scratch: bool) -> None:
    def arg(value: Any) -> Any:
        if isinstance(value, Ref):
            if value.sid in storages:
                return _view(storages[value.sid], value)
            assert scratch, "a kept op reads a storage not rebuilt"
            return torch.empty_strided(value.size, value.stride, dtype=value.dtype,
                                       device=_CPU).zero_()
        if isinstance(value, torch.device):
            return _CPU
        return value

    args, kwargs = tree_map(arg, (op.args, op.kwargs))
    if "device" in kwargs:
        kwargs["device"] = _CPU
    out = op.func(*args, **kwargs)
    if not scratch:
        leaves = tree_flatten(out)[0]
        for i, sid in op.fresh:
            storages[sid] = leaves[i].untyped_storage()


def tape_of(t: torch.Tensor) -> Tape | None:
    """The live tape that recorded ``t``'s storage, if any."""
    key = _key(t)
    ref = _TAPES.get(key) if key is not None else None
    return ref() if ref is not None else None


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        tree_map(self.tape._arg, (args, kwargs))  # constants copied before a write
        random = torch.Tag.nondeterministic_seeded in func.tags
        rng = self.tape.rng_before() if random else None
        out = func(*args, **kwargs)
        if random:
            self.tape.rng_after()
        self.tape.record(func, args, kwargs, out, rng)
        return out


class _Cutter(TorchDispatchMode):
    """Records an op reading recorded meta tensors onto their tape (a tensor-parallel
    shard cut from a delayed weight); every other op runs unrecorded."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        tapes = {t for t in map(tape_of, (a for a in tree_flatten((args, kwargs))[0]
                                          if isinstance(a, torch.Tensor) and a.is_meta))
                 if t is not None}
        if len(tapes) != 1 or torch.Tag.nondeterministic_seeded in func.tags:
            return func(*args, **kwargs)
        tape = tapes.pop()
        tree_map(tape._arg, (args, kwargs))
        out = func(*args, **kwargs)
        tape.record(func, args, kwargs, out, cut=True)
        return out


@contextmanager
def cutting() -> Iterator[None]:
    """Inside, a tensor made from a recorded meta tensor (a shard of a delayed weight) is
    recorded too, so materialising it gives the slice of the eager build's tensor."""
    with _Cutter():
        yield


class _FromData(TorchFunctionMode):
    """``torch.tensor(data)`` on meta copies its data below the dispatcher, unseen: make
    it on the host and move it to meta, so the data is recorded as a constant."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FROM_DATA and isinstance(out, torch.Tensor) and out.is_meta and \
                not any(isinstance(a, torch.Tensor) and a.is_meta for a in args[:1]):
            host = func(*args, **{**kwargs, "device": _CPU})
            out = host.to("meta")
        return out


def _recorded(original: Callable[..., Any]) -> Callable[..., Any]:
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.is_meta and _RECORDING:
            _RECORDING[-1].call(original, tensor, args, kwargs)
            return tensor
        return original(tensor, *args, **kwargs)
    init.smp_fx_original = original  # type: ignore[attr-defined]
    return init


@contextmanager
def _meta_skipping_inits() -> Iterator[None]:
    """``_SKIP_META``'s functions recorded inside, where ``torch.nn.init`` has them and
    where transformers keeps its own references to them."""
    tables: list[Any] = [vars(torch.nn.init)]
    hf = sys.modules.get("transformers.initialization")
    if hf is not None and isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf.TORCH_INIT_FUNCTIONS)
    saved = [(t, n, t[n]) for t in tables for n in _SKIP_META
             if n in t and not hasattr(t[n], "smp_fx_original")]
    for table, name, original in saved:
        table[name] = _recorded(original)
    try:
        yield
    finally:
        for table, name, original in saved:
            table[name] = original


@contextmanager
def recording(tape: Tape) -> Iterator[Tape]:
    """Record the ops run inside onto ``tape`` (a new one, or one to extend)."""
    _RECORDING.append(tape)
    try:
        with _meta_skipping_inits(), _FromData(), _Recorder(tape):
            yield tape
    finally:
        _RECORDING.pop()


@contextmanager
def paused() -> Iterator[None]:
    """Run inside without recording (real weights about to be moved to meta)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield
