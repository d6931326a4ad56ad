"""Reused byte buffers for the multi-process transport's received frames.

Every message the transport receives on CPU lands in a byte buffer (a *frame*, or a large
tensor's own buffer). Allocating a fresh one per message costs more than the copy into it:
the C allocator hands frames freed in bulk at the end of a step back to the kernel, and the
next step's first touches fault every page in again. ``BufferPool`` keeps them instead.
(Sent frames never leave the transport, which simply reuses them step after step.)

A buffer goes back to the pool when this rank no longer needs it (its message has been
unpacked), but a received message's tensors are *views* of its buffer that the stage keeps
until its backward, and that a caller may keep for longer. So a buffer is only handed out
again once no tensor views its storage any more (``unviewed``). Where that cannot be told
(another torch version), or on an accelerator (whose caching allocator already reuses
memory, and where the host cannot tell when a kernel still reads a buffer), every buffer
is new: only speed differs, never values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_MAX_KEPT = 64  # buffers kept per size; older ones are left to the allocator


def _storage_use_count() -> Callable[[torch.Tensor], int] | None:
    """How many tensors use a tensor's storage, from torch's private
    ``_storage_Use_Count``, as an offset from one unshared tensor's count (the count
    includes the temporary storage object); None where it is missing or miscounts."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None

    def count(t: torch.Tensor) -> int:
        return int(fn(t.untyped_storage()._cdata))

    try:
        probe = torch.empty(1, dtype=torch.uint8)
        base = count(probe)
        view = probe[:1]
        if count(probe) != base + 1:
            return None
        del view
    except (RuntimeError, TypeError, AttributeError):
        return None
    return lambda t: count(t) - base


_VIEWS = _storage_use_count()


def unviewed(buf: torch.Tensor) -> bool:
    """Whether no tensor but ``buf`` uses its storage (False where that cannot be told).

    Buys ~1.7 ms per step on the pipeline benchmark: the page faults of fresh frames every
    step (perf; docs/performance.md)."""
    return _VIEWS is not None and _VIEWS(buf) == 0


class BufferPool:
    """Byte buffers of one device, handed out again once nothing views them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reuse = device.type == "cpu" and _VIEWS is not None
        self._kept: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` that no tensor views (its contents are garbage)."""
        kept = self._kept.get(nbytes)
        if kept:
            for i, buf in enumerate(kept):
                if unviewed(buf):
                    return kept.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer this pool handed out and this rank is done with (views of it may
        still be alive: it is reused only after they are gone)."""
        if not self.reuse:
            return
        kept = self._kept.setdefault(buf.numel(), [])
        kept.append(buf)
        if len(kept) > _MAX_KEPT:
            del kept[0]
