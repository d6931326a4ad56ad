"""Manual partitioning: ``smp.partition(index)`` and ``smp.set_partition(module, index)``.

As in SMP, modules created inside a context belong to its partition (innermost wins);
torch has no construction hook, so ``nn.Module.__init__`` is wrapped while a context is
open. See docs/partitioning.md, 'Manual'.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

from cost_model.errors import SMPConfigError

_recorded: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_explicit: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_local = threading.local()
_lock = threading.Lock()
_open = 0
_original_init: Any = None


def _stack() -> list[int]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _check_index(index: object, where: str) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise SMPConfigError.build("a partition index must be an int >= 0", index, where,
                                   "use 0 .. pipeline_parallel_degree - 1")
    return index


def _install() -> None:
    global _open, _original_init
    with _lock:
        if _open == 0:
            original = nn.Module.__init__

            @functools.wraps(original)
            def recording_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
                stack = getattr(_local, "stack", None)
                if stack:
                    _recorded[self] = stack[-1]
                original(self, *args, **kwargs)

            _original_init = original
            nn.Module.__init__ = recording_init  # type: ignore[method-assign]
        _open += 1


def _uninstall() -> None:
    global _open, _original_init
    with _lock:
        _open -= 1
        if _open == 0:
            nn.Module.__init__ = _original_init  # type: ignore[method-assign]
            _original_init = None


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Place every module created inside the context on partition ``index``."""
    _check_index(index, "smp.partition")
    _install()
    stack = _stack()
    stack.append(index)
    try:
        yield
    finally:
        stack.pop()
        _uninstall()


def set_partition(module: nn.Module, index: int) -> None:
    """Pin ``module`` (and what it contains, unless pinned itself) to ``index``."""
    if not isinstance(module, nn.Module):
        raise SMPConfigError.build("set_partition expects an nn.Module", type(module).__name__,
                                   "smp.set_partition", "pass the module object")
    _explicit[module] = _check_index(index, "smp.set_partition")


def partition_of(module: nn.Module) -> int | None:
    """The index ``module`` itself was pinned to (``set_partition`` wins), or None."""
    if module in _explicit:
        return _explicit[module]
    return _recorded.get(module)


def pins_by_module_path(model: nn.Module) -> dict[str, int]:
    """``{module path: index}`` for every pinned module in ``model`` ('' = the root), a module
    reachable by several paths under each."""
    out: dict[str, int] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        index = partition_of(module)
        if index is not None:
            out[path] = index
    return dict(sorted(out.items()))
