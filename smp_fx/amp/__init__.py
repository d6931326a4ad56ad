"""``smp.amp``: SMP's mixed-precision helpers, which agree across every pipeline and
tensor-parallel rank. Names documented by SMP but not built yet raise
``SMPNotImplementedError`` on access (``smp_fx.namespaces``); built ones are plain
attributes of this package."""

from __future__ import annotations

from typing import Any

from smp_fx.amp.grad_scaler import GradScaler
from smp_fx.namespaces import planned

__all__ = ["GradScaler"]

PLANNED: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    planned("smp.amp", name, PLANNED)
