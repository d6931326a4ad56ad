"""What apex's fused optimizers share, written once: ``set_grad_none``, the optional closure,
and Adam's direction (LAMB's too); each optimizer's own update is its ``_update``.
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

    def _adam_direction(self, p: torch.Tensor, g: torch.Tensor, group: dict[str, Any],
                        beta3: float, adam_w_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(``p`` in fp32, Adam's update direction ``u`` for the fp32 gradient ``g``):
        ``m = beta1 m + beta3 g``, ``v = beta2 v + (1 - beta2) g^2``,
        ``u = (m / bc1) / (sqrt(v / bc2) + eps)`` (+ ``weight_decay * p`` in AdamW mode;
        L2 mode adds it to ``g`` first). Advances ``p``'s moments in ``self.state``."""
        beta1, beta2 = group["betas"]
        step, decay, eps = group["step"], group["weight_decay"], group["eps"]
        bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
        bc2 = 1 - beta2**step if group["bias_correction"] else 1.0
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        m32, v32, p32 = state["exp_avg"].float(), state["exp_avg_sq"].float(), p.float()
        if not adam_w_mode:
            g = g + decay * p32
        m32.mul_(beta1).add_(g, alpha=beta3)
        v32.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        update = (m32 / bc1) / ((v32 / bc2).sqrt() + eps)
        if adam_w_mode:
            update = update + decay * p32
        state["exp_avg"].copy_(m32)
        state["exp_avg_sq"].copy_(v32)
        return p32, update
