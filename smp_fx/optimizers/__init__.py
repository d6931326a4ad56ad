"""``smp.optimizers``: SMP's fused optimizers, written in plain torch in place of apex's.
Names documented by SMP but not built yet raise ``SMPNotImplementedError`` on access
(``smp_fx.namespaces``); built ones are plain attributes of this package."""

from __future__ import annotations

from typing import Any

from smp_fx.namespaces import planned
from smp_fx.optimizers.adam import FusedAdam
from smp_fx.optimizers.lamb import FusedLamb
from smp_fx.optimizers.novograd import FusedNovoGrad

FusedLAMB = FusedLamb
"""apex's spelling (``apex.optimizers.FusedLAMB``), which AWS's BERT scripts import from
``smdistributed.modelparallel.torch.optimizers``: the same class."""

__all__ = ["FusedAdam", "FusedLAMB", "FusedLamb", "FusedNovoGrad"]

PLANNED: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    planned("smp.optimizers", name, PLANNED)
