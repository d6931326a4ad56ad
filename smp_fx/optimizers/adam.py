"""``smp.optimizers.FusedAdam``: apex's ``FusedAdam`` in plain torch.

With bias correction it is ``AdamW`` or ``Adam``; apex's signature and
``bias_correction=False`` are why it exists. See docs/precision.md, 'apex replacements'.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.ones(2)
>>> FusedAdam([w], lr=0.1).step(); w.detach().tolist()
[0.8999999761581421, 0.8999999761581421]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cost_model.errors import SMPConfigError
from smp_fx.optimizers.apex_style import ApexStyleOptimizer


class FusedAdam(ApexStyleOptimizer):
    """Adam / AdamW with ``apex.optimizers.FusedAdam``'s signature (see the module doc)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        if amsgrad:
            raise SMPConfigError.build("FusedAdam does not support the AMSGrad variant", True,
                                       "smp.optimizers.FusedAdam", "pass amsgrad=False")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def _update(self) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                p32, update = self._adam_direction(p, p.grad.float(), group,
                                                   1 - group["betas"][0], self.adam_w_mode)
                p.copy_(p32 - group["lr"] * update)
