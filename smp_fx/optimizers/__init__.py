"""``smp.optimizers``: SMP's fused optimizers. Names documented by SMP but not built yet
raise ``SMPNotImplementedError`` on access (``smp_fx.namespaces``); built ones are plain
attributes of this package."""

from __future__ import annotations

from typing import Any

from smp_fx.namespaces import planned

PLANNED: dict[str, str] = {
    "FusedLamb": "SMP's replacement for apex's FusedLAMB optimizer",
    "FusedNovoGrad": "SMP's replacement for apex's FusedNovoGrad optimizer",
    "FusedAdam": "SMP's replacement for apex's FusedAdam optimizer",
}


def __getattr__(name: str) -> Any:
    planned("smp.optimizers", name, PLANNED)
