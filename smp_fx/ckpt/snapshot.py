"""A checkpoint's state copied off the training tensors, so training can go on while it is written.

An asynchronous save (``smp_fx.ckpt.async_save``) writes from a background thread while the
next steps update the parameters and optimizer state in place; it must write the values of
the moment it was called. ``Snapshot.take`` copies every tensor of a (nested) state to host
memory: on a GPU into pinned buffers, reused from the previous save when the shapes agree
(pinning is slow; one save is in flight at a time, so its buffers are free again), with the
copies queued on the current stream and awaited by the writer (``ready``); on the CPU a
plain clone. Dicts, lists and plain tuples are rebuilt; other values are kept as they are.
"""

from __future__ import annotations

from typing import Any

import torch


class Snapshot:
    """Host copies of a state's tensors (see the module doc); one per process, reused."""

    def __init__(self) -> None:
        self._pinned: list[torch.Tensor] = []
        self._used = 0
        self._event: Any = None

    def take(self, value: Any) -> Any:
        """``value`` with every tensor replaced by a host copy of it, taken now."""
        self._used = 0
        copied = self._copy(value)
        del self._pinned[self._used:]  # buffers of a larger earlier state go
        if self._event is not None:
            self._event.record()
        return copied

    def ready(self) -> None:
        """Wait until the device-to-host copies of the last ``take`` are complete (the
        writer thread calls it before reading them)."""
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
        if t.device.type != "cuda":
            return t.clone()
        if self._event is None:
            self._event = torch.cuda.Event()
        i = self._used
        self._used += 1
        if i < len(self._pinned) and self._pinned[i].shape == t.shape \
                and self._pinned[i].dtype == t.dtype:
            buf = self._pinned[i]
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            if i < len(self._pinned):
                self._pinned[i] = buf
            else:
                self._pinned.append(buf)
        buf.copy_(t, non_blocking=True)
        return buf
