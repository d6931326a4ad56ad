"""SMP's private modules that AWS's example scripts import, answered by smp-fx.

``register`` puts them in ``sys.modules`` under SMP's names, since files under the shim's
``smdistributed.modelparallel.torch`` (``smp_fx`` itself) cannot be found by path.
"""

from __future__ import annotations

import importlib
import sys

MODULES: dict[str, str] = {
    "smdistributed.modelparallel.torch.state_mod": "smp_fx._compat.private.state_mod",
    "smdistributed.modelparallel.torch.utils": "smp_fx._compat.private.utils",
}
"""SMP's private module name -> the smp-fx module that answers it (the test helpers have a
shim package of their own: ``smdistributed.modelparallel.test``)."""


PARENT = "smdistributed.modelparallel.torch"
"""The shim name that is ``smp_fx`` itself."""


def register() -> None:
    """Make each of ``MODULES`` importable under SMP's name (one module object each), and an
    attribute of its parent as the import system makes a submodule (``import
    smdistributed.modelparallel.torch.utils as u`` reads it from ``smp_fx``, which the
    parent name is)."""
    smp_fx = importlib.import_module("smp_fx")
    for alias, real in MODULES.items():
        module = sys.modules.get(alias) or importlib.import_module(real)
        sys.modules[alias] = module
        parent, _, child = alias.rpartition(".")
        if parent == PARENT:
            setattr(smp_fx, child, module)


__all__ = ["MODULES", "register"]
