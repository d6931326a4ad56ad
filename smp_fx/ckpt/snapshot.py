"""A checkpoint's state copied off the training tensors, so training can go on while it is written.

An asynchronous save (``smp_fx.ckpt.async_save``) writes from a background thread while the
next steps update the parameters and optimizer state in place; it must write the values of
the moment it was called. ``Snapshot.take`` copies every tensor of a (nested) state to host
memory, into buffers reused from the previous save when the layouts agree (one save is in
flight at a time, so its buffers are free again; ``Snapshot._buffer``): on a GPU pinned
ones, the copies queued on the current stream and awaited by the writer (``ready``); on the
CPU page-aligned ones (``aligned_like``), the copies of the tensors only an optimizer step
or a load changes taken by the writer thread while the next step's forward and backward
run (``Snapshot.defer``). Dicts, lists and plain tuples are rebuilt; other values are kept
as they are.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Collection
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from cost_model.errors import SMPTimeoutError
from smp_fx.ckpt import direct_io
from smp_fx.world import launch

_copying: Snapshot | None = None  # the snapshot whose deferred copies are not all taken
_hooked = False


def copy_into(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The deferred copies, source into destination, in one call that releases the GIL once
    (tests hold them back): each GIL hand-over between the writer and the training thread
    waits for the other's turn on a contended CPU."""
    if pairs:
        torch._foreach_copy_([d for _, d in pairs], [s for s, _ in pairs])


def wait_copied() -> None:
    """Block until the deferred copies of the save in flight are taken: the first thing
    that changes saved state in place (an optimizer's step, a load) calls it."""
    snap = _copying
    if snap is not None and not snap.copied.wait(launch.timeout().total_seconds()):
        raise SMPTimeoutError.build(
            "the asynchronous checkpoint's copy of the state was not taken in time",
            launch.timeout(), where="before an optimizer step or load_state_dict",
            fix="look for a stuck checkpoint writer thread; raise SMP_FX_TIMEOUT_S if the "
            "copy is just slow")


def _before_optimizer_step(*_: Any) -> None:
    wait_copied()


def aligned_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised CPU tensor like ``t`` whose bytes begin on a page (anonymous
    memory), so ``direct_io.DirectFile`` writes it without a copy (``aligned_storages``);
    small or non-contiguous tensors are allocated as ``torch.empty_like`` does."""
    size = t.numel() * t.element_size()
    if size < direct_io.CHUNK or not t.is_contiguous():
        return torch.empty_like(t, memory_format=torch.preserve_format, device="cpu")
    return torch.frombuffer(mmap.mmap(-1, size), dtype=t.dtype, count=t.numel()).view(t.shape)


class Snapshot:
    """Host copies of a state's tensors (see the module doc); one per process, reused."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._used = 0
        self._event: Any = None
        self._stepped: Collection[int] = ()
        self._later: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.copied = threading.Event()
        self.copied.set()

    def take(self, value: Any, stepped: Collection[int] = ()) -> Any:
        """``value`` with every tensor replaced by a host copy of it, of this moment; on
        the CPU the copies of tensors whose storage is in ``stepped`` (data pointers of
        what only an optimizer step or a load changes) are left to ``ready``."""
        wait_copied()
        self._used, self._stepped, self._later = 0, stepped, []
        copied = self._copy(value)
        del self._buffers[self._used:]  # buffers of a larger earlier state go
        if self._event is not None:
            self._event.record()
        if self._later:
            self.defer()
        return copied

    def defer(self) -> None:
        """Leave the CPU copies of parameters and optimizer state to the writer thread
        (``ready``), which takes them while the next step's forward and backward run;
        every optimizer's step (a global pre-hook) and load wait for them first. Measured
        at pp 2 x dp 2 (``benchmarks/async_checkpoint.py``, 151 MB on a rank): the save
        call 0.13-0.22 -> 0.05-0.06 s; the optimizer has not waited (<= 0.001 s)."""
        global _copying, _hooked
        if not _hooked:
            register_optimizer_step_pre_hook(_before_optimizer_step)
            _hooked = True
        self.copied.clear()
        _copying = self

    def drop(self) -> None:
        """Forget the deferred copies of a save that failed before its writer started."""
        global _copying
        self._later = []
        if _copying is self:
            _copying = None
        self.copied.set()

    def ready(self) -> None:
        """Take the deferred copies, then wait until the device-to-host copies of the last
        ``take`` are complete (the writer thread calls it before reading them)."""
        global _copying
        if not self.copied.is_set():
            try:
                copy_into(self._later)
            finally:
                self._later = []
                _copying = None
                self.copied.set()
        if self._event is not None:
            self._event.synchronize()

    def _copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value.detach())
        if isinstance(value, dict):
            return type(value)((k, self._copy(v)) for k, v in value.items())
        if isinstance(value, list):
            return [self._copy(v) for v in value]
        if type(value) is tuple:  # a subclass (torch.Size, a named tuple) is kept whole
            return tuple(self._copy(v) for v in value)
        return value

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffer(t)
        if t.device.type != "cuda":
            if t.untyped_storage().data_ptr() in self._stepped:
                self._later.append((t, buf))
            else:
                buf.copy_(t)
            return buf
        if self._event is None:
            self._event = torch.cuda.Event()
        buf.copy_(t, non_blocking=True)
        return buf

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        """The host buffer the copy of ``t`` goes into: the previous save's at the same
        place when it has the same layout (one save is in flight at a time), else a new
        one, pinned for a GPU's tensor. Reusing them spares the CPU the page faults of
        fresh memory: the deferred copy of 151 MB took 0.042 s of the writer's CPU into
        new tensors and 0.013 s into reused ones (``benchmarks/async_checkpoint.py``,
        rank 0); the buffers stay allocated between saves."""
        i = self._used
        self._used += 1
        pin = t.device.type == "cuda"
        if i < len(self._buffers):
            old = self._buffers[i]
            if old.shape == t.shape and old.dtype == t.dtype and (
                    pin or old.stride() == t.stride()):
                return old
        buf = (torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) if pin
               else aligned_like(t))
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf
