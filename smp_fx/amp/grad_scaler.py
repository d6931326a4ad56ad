"""``smp.amp.GradScaler``: ``torch.amp.GradScaler`` whose inf check spans every rank.

A stage sees only its gradients, so its own check would skip steps others take; the flag
is max-reduced over the world group, so every rank skips alike and keeps one scale. Use it
with autocast; ``scaler.step`` on every rank. See docs/precision.md, 'bf16 and
``smp.amp.GradScaler``'.
"""

from __future__ import annotations

import torch

from smp_fx.amp.loss_scaler import agree_found_inf
from smp_fx.world import state


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with the inf check agreed over every rank; its scale tensor is
    made at once (``smp.step`` scales from several threads)."""

    def __init__(self, device: str | None = None, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        if device is None:
            device = state.get().device.type if state.is_initialized() else "cuda"
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        if self._enabled:
            where = state.get().device if state.is_initialized() else torch.device(device)
            self._lazy_init_scale_growth_tracker(where)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """torch's ``unscale_``, then one max all-reduce of the found-inf flag over the
        world; every rank makes exactly one, even one without gradients."""
        super().unscale_(optimizer)
        if not self._enabled:
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        assert self._scale is not None
        flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for value in found.values():
            flag = torch.maximum(flag, value.to(flag.device))
        agree_found_inf(flag)
        if not found:
            found[self._scale.device] = flag.clone()
        for dev, value in found.items():
            value.copy_(flag.to(dev))
