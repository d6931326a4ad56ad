"""A thread's grad mode and autocast, captured in one thread and applied in another, since
the work a step function asks for runs in whichever thread holds the baton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

Autocast = tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) per enabled autocast

_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)
_NO_CHANGE = contextlib.nullcontext()  # reusable: the usual result of ``thread_modes``


def autocast_state() -> Autocast:
    """The calling thread's enabled autocasts (one call when none is on, the usual case)."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return ()
    out = []
    for dev in ("cpu", "cuda"):
        if torch.is_autocast_enabled(dev):
            out.append((dev, torch.get_autocast_dtype(dev)))
    return tuple(out)


def thread_modes(grad_enabled: bool, autocast: Autocast) -> Any:
    """A context with the requesting thread's grad mode and autocast in this thread (the
    usual case, modes already equal, returns a shared no-op context)."""
    current = autocast_state()
    if current == autocast:
        if torch.is_grad_enabled() == grad_enabled:
            return _NO_CHANGE
        return torch.set_grad_enabled(grad_enabled)
    return _switch_modes(grad_enabled, autocast, current)


@contextlib.contextmanager
def _switch_modes(grad_enabled: bool, autocast: Autocast, current: Autocast) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad_enabled))
        wanted = dict(autocast)
        for dev, _ in current:  # this thread's own autocast does not apply to the work
            if dev not in wanted:
                stack.enter_context(torch.autocast(dev, enabled=False))
        for dev, dtype in autocast:
            stack.enter_context(torch.autocast(dev, dtype=dtype))
        yield
