"""Manual partitioning: ``smp.partition(index)`` and ``smp.set_partition(module, index)``.

As in SMP, modules *created* inside ``with smp.partition(i):`` belong to partition ``i``;
with nested contexts the innermost wins; every other module goes to ``default_partition``;
the contexts are ignored when ``auto_partition`` is true (the plan builder simply does not
run ``passes.assign_manual`` then). ``set_partition`` pins a module created elsewhere and
overrides any context.

How creation is recorded, without touching the user's model: a thread-local stack of open
indices, and a ``WeakKeyDictionary`` module -> index (modules stay collectable; nothing is
stored on them). torch has no global *construction* hook: its global
``register_module_module_registration_hook`` fires when a module is assigned to a parent,
which is not SMP's rule (a module built inside a context and attached outside it, or
a root model built inside one, would be missed; one built outside and attached inside
would be wrongly pinned). So while at least one context is open in any thread,
``nn.Module.__init__`` is wrapped by a recorder that notes the innermost index of the
*constructing* thread; the wrapper is installed when the first context opens and removed
when the last one closes (counted under a lock, so it is re-entrant and thread-safe), and
modules created with no context open in their thread are not recorded.

The index is checked against the number of partitions when the plan is made
(``passes.assign_manual``), because SMP scripts may build the model before or after
``smp.init``; a negative or non-int index is rejected at once.

Example::

    with partition(1):
        layer = torch.nn.Linear(2, 2)
    pins_by_module_path(torch.nn.Sequential(layer))  # {'0': 1}
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
    """``{module path: index}`` for every pinned module in ``model`` ('' = the root).

    A module reachable under several paths is listed under each. Unpinned modules are
    absent; ``passes.assign_manual`` gives them their innermost pinned ancestor's index, or
    ``default_partition``.
    """
    out: dict[str, int] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        index = partition_of(module)
        if index is not None:
            out[path] = index
    return dict(sorted(out.items()))
