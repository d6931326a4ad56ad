"""What apex's fused optimizers share, written once for smp-fx's plain-torch ones.

apex's ``FusedLAMB``, ``FusedNovoGrad`` and ``FusedAdam`` all take ``set_grad_none``
(``zero_grad`` sets gradients to None unless told otherwise) and accept an optional
closure in ``step``; the update itself is each optimizer's ``_update``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ApexStyleOptimizer(torch.optim.Optimizer):
    """Base of ``smp.optimizers``' apex replacements; subclasses define ``_update``."""

    set_grad_none: bool = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """apex's: gradients to None when ``set_grad_none`` (the default)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None
                          else set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Evaluate ``closure`` (with gradients enabled) if given, then update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    def _update(self) -> None:
        raise NotImplementedError
