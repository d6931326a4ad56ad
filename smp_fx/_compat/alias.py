"""``smdistributed.modelparallel.torch.<sub>`` is ``smp_fx.<sub>``: one module object.

Without ``SubmoduleAlias`` (a meta-path finder) a submodule imported through the shim's
name would run a second time under another name: a second copy of its classes and
registrations.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

ALIASED = "smdistributed.modelparallel.torch."
TARGET = "smp_fx."


class SubmoduleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``ALIASED + x`` -> the module ``TARGET + x`` (which must exist)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(ALIASED):
            return None
        real = TARGET + fullname[len(ALIASED):]
        if real not in sys.modules and importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(TARGET + spec.name[len(ALIASED):])

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its own name."""


def install() -> None:
    """Put the alias first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, SubmoduleAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, SubmoduleAlias())


__all__ = ["SubmoduleAlias", "install"]
