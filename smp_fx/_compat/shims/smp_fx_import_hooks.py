"""Post-import hooks: run a function on a module right after it is first imported.

transformers imports ``smdistributed`` halfway through its own import, too late to hook it
from there, so hooks are registered at start-up (``sitecustomize``). Imports neither torch
nor smp-fx.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

HOOKS: dict[str, str] = {
    "transformers.training_args": "smp_fx._compat.hf_trainer:after_training_args",
    "transformers.trainer": "smp_fx._compat.hf_trainer:after_trainer",
}
"""module name -> "module:function" called with the module once it has been executed."""


def _call(target: str, module: ModuleType) -> None:
    where, _, name = target.partition(":")
    __import__(where)
    hook: Callable[[ModuleType], None] = getattr(sys.modules[where], name)
    hook(module)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the hook."""

    def __init__(self, inner: Any, target: str) -> None:
        self.inner = inner
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _call(self.target, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the hooked modules through the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        hook = HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, hook)
                return spec
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
