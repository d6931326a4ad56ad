"""``smp.amp``: mixed-precision helpers that agree across every pipeline and tensor rank."""

from __future__ import annotations

from smp_fx.amp.grad_scaler import GradScaler

__all__ = ["GradScaler"]
