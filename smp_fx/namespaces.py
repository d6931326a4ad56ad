"""SMP's submodule namespaces (``smp.nn``, ``smp.optimizers``, ``smp.amp``) and their names
that are known but not built yet: those raise ``SMPNotImplementedError`` saying what the
name is for, not an ``AttributeError`` that reads like a typo.

>>> planned("smp.nn", "FlashAttentionLayer", {"FlashAttentionLayer": "flash attention"})
Traceback (most recent call last):
...
smp_fx.SMPNotImplementedError: 'smp.nn.FlashAttentionLayer' (flash attention...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NoReturn

from cost_model.errors import not_implemented

# top-level ``smp.<name>`` of SMP v1 not built yet (answered by ``smp_fx.__getattr__``)
PLANNED: dict[str, str] = {}


def planned(namespace: str, name: str, known: Mapping[str, str]) -> NoReturn:
    """Raise for ``namespace.name``: not implemented if SMP documents it, else missing."""
    if name in known:
        raise not_implemented(known[name], f"{namespace}.{name}",
                              "See README 'Not supported yet'.")
    raise AttributeError(f"module {namespace!r} has no attribute {name!r}")
