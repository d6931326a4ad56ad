"""``smp.optimizers``: optimizers SMP provides in place of apex's fused ones."""

from __future__ import annotations

from smp_fx.optimizers.lamb import FusedLamb
from smp_fx.optimizers.novograd import FusedNovoGrad

__all__ = ["FusedLamb", "FusedNovoGrad"]
