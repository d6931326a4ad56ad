"""``smp.amp.GradScaler``: ``torch.amp.GradScaler`` whose inf check spans every rank.

torch's scaler decides from the gradients this process holds. A pipeline stage holds only
its own, so one stage would skip a step that the others take, and their scales would part.
This subclass changes one thing: after ``unscale_`` finds (or does not find) infs in the
local gradients, the flag is max-reduced over the world group
(``smp_fx.amp.loss_scaler.agree_found_inf``), so every pp, tp and dp rank skips the same
steps and ``update()`` leaves the same scale everywhere. ``step`` and ``update`` are
torch's. Use it with autocast (fp32 parameters, half activations), as the SMP docs say:

    scaler = smp.amp.GradScaler()

    @smp.step
    def train_step(model, data, target):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.nll_loss(model(data), target)
        model.backward(scaler.scale(loss))
        return loss

    train_step(model, data, target)
    scaler.step(optimizer)       # on every rank: the inf check is a collective
    scaler.update()

The optimizer is stepped through ``unscale_`` + ``optimizer.step()`` always (a
``DistributedOptimizer`` reports ``_step_supports_amp_scaling = False``), so the agreed
flag is the one that decides.
"""

from __future__ import annotations

import torch

from smp_fx.amp.loss_scaler import agree_found_inf
from smp_fx.world import state


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with the inf check agreed over every rank.

    ``device`` defaults to the smp device's type ("cuda" or "cpu"). The scale tensor is
    created at once (torch creates it at the first ``scale`` call, which smp.step makes
    from several microbatch threads).
    """

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
