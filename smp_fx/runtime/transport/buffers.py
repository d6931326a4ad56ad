"""Reused byte buffers for the multi-process transport's received frames.

A fresh buffer per message costs more than the copy into it (page faults); a buffer is
handed out again once no tensor views it (``unviewed``), and where that cannot be told
every buffer is new: only speed differs. See docs/performance.md, 'Transport'.
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
    """Buffers of one device, by size and dtype, handed out again once nothing views them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reuse = device.type == "cpu" and _VIEWS is not None
        self._kept: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def take(self, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A flat buffer of ``nbytes`` (a multiple of ``dtype``'s size) that no tensor views
        (its contents are garbage)."""
        kept = self._kept.get((nbytes, dtype))
        if kept:
            for i, buf in enumerate(kept):
                if unviewed(buf):
                    return kept.pop(i)
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer this pool handed out and this rank is done with (views of it may
        still be alive: it is reused only after they are gone)."""
        if not self.reuse:
            return
        kept = self._kept.setdefault((buf.numel() * buf.dtype.itemsize, buf.dtype), [])
        kept.append(buf)
        if len(kept) > _MAX_KEPT:
            del kept[0]
