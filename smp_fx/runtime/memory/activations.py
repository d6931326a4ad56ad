"""What a stage keeps for backward: saved-tensor hooks that count it and offload it.

Without either job no hook is installed, so a plain stage pays nothing.
See docs/memory.md, 'At run time'.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from smp_fx.runtime.executor.lowering import Op

_active = threading.local()


@dataclass
class SavedRecord:
    """Bytes one microbatch's forward left saved on a stage (``offloaded``: off-device)."""

    saved: int = 0
    offloaded: int = 0
    rebuilt: int = 0  # checkpointed regions rebuilt for a split backward, kept until its W

    @property
    def on_device(self) -> int:
        return self.saved - self.offloaded


class _Offloaded:
    """A saved region input that left the device; ``load`` brings it back."""

    def __init__(self, t: torch.Tensor, stream: Any) -> None:
        self.device = t.device
        self.stream = stream
        self.loaded: torch.Tensor | None = None
        self.event: Any = None
        if stream is None:
            self.host = t.detach().to("cpu", copy=True)
            self.pending: torch.Tensor | None = None
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            self.host.copy_(t.detach(), non_blocking=True)
        self.pending = t  # alive until the copy is done (``settle``)
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def settle(self) -> None:
        if self.pending is not None:
            self.event.synchronize()
            self.pending = None

    def load(self) -> None:
        if self.loaded is not None:
            return
        if self.stream is None:
            self.loaded = self.host.to(self.device, copy=True)
            return
        self.settle()
        with torch.cuda.stream(self.stream):
            self.loaded = self.host.to(self.device, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(self.stream)

    def unpack(self) -> torch.Tensor:
        if self.loaded is None:
            self.load()
        assert self.loaded is not None
        out, self.loaded = self.loaded, None
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.event)
            out.record_stream(current)  # made on the side stream, freed after use here
        return out


class ActivationKeeper:
    """The saved-tensor hooks of one stage (see the module docstring)."""

    def __init__(self, state: Sequence[torch.Tensor], offload: bool = False,
                 track: bool = False) -> None:
        self.state = list(state)
        self.excluded: set[int] = set()
        self.offload = offload
        self.track = track
        self.records: dict[int, SavedRecord] = {}
        self._handles: dict[int, list[_Offloaded]] = {}
        self._stream: Any = None
        self._mb = 0
        self._plain: set[int] = set()
        self._region: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._spans: dict[int, tuple[int, int]] = {}

    @property
    def active(self) -> bool:
        return self.offload or self.track

    @contextlib.contextmanager
    def forward(self, microbatch: int) -> Iterator[None]:
        """Around one forward of the stage: hooks on, the record of ``microbatch`` after."""
        if not self.active or not torch.is_grad_enabled():
            yield
            return
        self._mb, self._plain, self._region, self._sizes = microbatch, set(), {}, {}
        self._spans = {}
        self.excluded = {_key(t) for t in self.state}  # where they live at this forward (model.to)
        self._handles[microbatch] = []
        record = self.records[microbatch] = SavedRecord()
        _active.keeper = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack_plain, _unpack):
                yield
        finally:
            _active.keeper = None
        sizes = self._sizes
        leaving = sum(b for k, b in self._region.items() if k not in self._plain)
        record.saved = sum(sizes.get(k, 0) for k in self._plain | set(self._region))
        record.offloaded = leaving if self.offload else 0
        for h in self._handles[microbatch]:
            h.settle()

    def _count(self, t: torch.Tensor) -> int | None:
        key = _key(t)
        if key in self.excluded:
            return None
        lo, hi = _span(t)
        was = self._spans.get(key)
        if was is not None:
            lo, hi = min(lo, was[0]), max(hi, was[1])
        self._spans[key] = (lo, hi)
        self._sizes[key] = hi - lo
        return key

    def _pack_plain(self, t: torch.Tensor) -> Any:
        key = self._count(t)
        if key is not None:
            self._plain.add(key)
        return t

    def _pack_region(self, t: torch.Tensor) -> Any:
        key = self._count(t)
        if key is None:
            return t
        self._region[key] = self._sizes[key]
        if not self.offload:
            return t
        if self._stream is None and t.device.type == "cuda":
            self._stream = torch.cuda.Stream(t.device)
        handle = _Offloaded(t, self._stream if t.device.type == "cuda" else None)
        self._handles[self._mb].append(handle)
        return handle

    def region_hooks(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autograd.graph.saved_tensors_hooks(self._pack_region, _unpack)

    def prefetch(self, microbatch: int) -> None:
        """Start bringing ``microbatch``'s offloaded region inputs back to the device."""
        for h in self._handles.pop(microbatch, []):
            h.load()

    def end_step(self) -> None:
        self._handles.clear()


def _unpack(packed: Any) -> torch.Tensor:
    return packed.unpack() if isinstance(packed, _Offloaded) else packed


def rebuild_sink() -> Callable[[int], None] | None:
    """Where a checkpointed region made in this thread's stage forward reports the bytes
    its recompute rebuilt and keeps (``smp_fx.runtime.memory.recompute_once``): that microbatch's
    record (None outside a counting stage forward)."""
    keeper = getattr(_active, "keeper", None)
    if keeper is None:
        return None
    record = keeper.records[keeper._mb]

    def sink(nbytes: int) -> None:
        record.rebuilt += nbytes

    return sink


def region_hooks() -> contextlib.AbstractContextManager[Any]:
    """The hooks a checkpointed region's inputs are saved under on this thread's stage."""
    keeper = getattr(_active, "keeper", None)
    return keeper.region_hooks() if keeper is not None else contextlib.nullcontext()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a saved tensor spans, first element to last: the views a
    split makes (q, k, v of one fused projection) span their storage together, while a
    microbatch, a slice of the caller's batch, spans only its own rows."""
    size = t.element_size()
    lo = int(t.storage_offset()) * size
    if t.numel() == 0:
        return lo, lo
    last = sum((int(n) - 1) * abs(int(st)) for n, st in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * size


def prefetch_points(ops: Sequence[Op], stage: int, horizon: int) -> dict[int, list[int]]:
    """Op position -> microbatches whose offloaded inputs start back before that op:
    ``horizon`` tasks before the backward, never before they left."""
    tasks = [(i, op) for i, op in enumerate(ops) if op.stage == stage
             and op.kind in ("F", "B", "I", "W")]
    forward_at = {op.microbatch: k for k, (_, op) in enumerate(tasks) if op.kind == "F"}
    out: dict[int, list[int]] = {}
    for k, (_, op) in enumerate(tasks):
        if op.kind not in ("B", "I") or op.microbatch not in forward_at:
            continue
        at = max(k - horizon, forward_at[op.microbatch] + 1)
        out.setdefault(tasks[at][0], []).append(op.microbatch)
    return out
