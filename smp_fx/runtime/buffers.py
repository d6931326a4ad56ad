"""Reused byte buffers for the multi-process transport's received frames.

Every message the transport receives on CPU lands in a byte buffer (a *frame*, or a large
tensor's own buffer). Allocating a fresh one per message costs more than the copy into it:
the C allocator hands frames freed in bulk at the end of a step back to the kernel, and
the next step's first touches fault every page in again (measured on the pipeline
benchmark: about 1.7 ms of page faults per step). ``BufferPool`` keeps them instead.
(Sent frames never leave the transport, which simply reuses them step after step.)

A buffer goes back to the pool when this rank no longer needs it (its message has been
unpacked), but a received message's tensors are *views* of its buffer
that the stage keeps until its backward, and that a caller may keep for longer. So a
buffer is only handed out again once no tensor views its storage any more: the pool asks
the storage's use count, which needs a private torch function. Without it (another torch
version), or on an accelerator (whose caching allocator already reuses memory, and where
the host cannot tell when a kernel still reads a buffer), every buffer is new, as before:
only speed differs, never values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_MAX_KEPT = 64  # buffers kept per size; older ones are left to the allocator


def _use_counter() -> Callable[[torch.Tensor], int] | None:
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None

    def count(t: torch.Tensor) -> int:
        return int(fn(t.untyped_storage()._cdata))

    try:  # the count includes the temporary storage object: learn the baseline
        probe = torch.empty(1, dtype=torch.uint8)
        base = count(probe)
        view = probe[:1]
        if count(probe) != base + 1:
            return None
        del view
    except (RuntimeError, TypeError, AttributeError):
        return None
    return lambda t: count(t) - base


_COUNT = _use_counter()


class BufferPool:
    """Byte buffers of one device, handed out again once nothing views them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reuse = device.type == "cpu" and _COUNT is not None
        self._kept: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` that no tensor views (its contents are garbage)."""
        kept = self._kept.get(nbytes)
        if kept:
            assert _COUNT is not None
            for i, buf in enumerate(kept):
                if _COUNT(buf) == 0:
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
