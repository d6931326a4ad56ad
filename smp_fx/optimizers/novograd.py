"""``smp.optimizers.FusedNovoGrad``: apex's ``FusedNovoGrad`` in plain torch: a first moment
per element, a second moment per tensor. See docs/precision.md, 'apex replacements'.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from cost_model.errors import SMPConfigError
from smp_fx.optimizers.apex_style import ApexStyleOptimizer


class FusedNovoGrad(ApexStyleOptimizer):
    """NovoGrad with ``apex.optimizers.FusedNovoGrad``'s signature (see the module doc)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False,
                 reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False,
                 set_grad_none: bool = True) -> None:
        if amsgrad:
            raise SMPConfigError.build("FusedNovoGrad does not support the AMSGrad variant",
                                       True, "smp.optimizers.FusedNovoGrad",
                                       "pass amsgrad=False")
        if norm_type not in (0, 2):
            raise SMPConfigError.build("FusedNovoGrad supports the L2 (2) and inf (0) norms",
                                       norm_type, "smp.optimizers.FusedNovoGrad",
                                       "pass norm_type=2 or 0")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults)
        self.reg_inside_moment = reg_inside_moment
        self.set_grad_none = set_grad_none

    def _update(self) -> None:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            self._update_group(group)

    def _update_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        step = group["step"]
        bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
        bc2 = math.sqrt(1 - beta2**step) if group["bias_correction"] else 1.0
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        decay, lr, eps = group["weight_decay"], group["lr"], group["eps"]
        l2 = group["norm_type"] == 2
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad.float()
            n = torch.linalg.vector_norm(g) if l2 else g.abs().max()
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros((), dtype=torch.float32, device=p.device) \
                    if group["init_zero"] else n.clone()
            v = state["exp_avg_sq"]
            if l2:
                v.copy_((beta2 * v * v + (1 - beta2) * n * n).sqrt())
            else:
                v.copy_(beta2 * v + (1 - beta2) * n)
            denom = v / bc2 + eps
            m = state["exp_avg"].float()
            p32 = p.float()
            if self.reg_inside_moment:
                m.mul_(beta1).add_(g / denom + decay * p32, alpha=beta3)
                p32 = p32 - lr * (m / bc1)
            else:
                m.mul_(beta1).add_(g, alpha=beta3)
                p32 = p32 - lr * ((m / bc1) / denom + decay * p32)
            p.copy_(p32)
            state["exp_avg"].copy_(m)
