"""``smp.amp``: SMP's mixed-precision helpers. Names documented by SMP but not built yet
raise ``SMPNotImplementedError`` on access (``smp_fx.namespaces``); built ones are plain
attributes of this package."""

from __future__ import annotations

from typing import Any

from smp_fx.namespaces import planned

PLANNED: dict[str, str] = {
    "GradScaler": "SMP's replacement for torch.amp.GradScaler, whose inf check spans every "
                  "pipeline and tensor-parallel rank",
}


def __getattr__(name: str) -> Any:
    planned("smp.amp", name, PLANNED)
