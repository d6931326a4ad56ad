"""``smp.optimizers.FusedLamb``: apex's ``FusedLAMB`` in plain torch, with a global norm.

Its first stage needs the whole model's gradient norm, which a pipeline stage cannot see;
wrapped in ``smp.DistributedOptimizer`` it gets the global one (``set_grad_norm_fn``).
See docs/precision.md, 'apex replacements'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from cost_model.errors import SMPConfigError
from smp_fx.optimizers.apex_style import ApexStyleOptimizer

GradNormFn = Callable[[list[torch.Tensor]], torch.Tensor]


def local_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``params``' gradients (per-tensor norms in fp32, as apex)."""
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in params
             if p.grad is not None]
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


class FusedLamb(ApexStyleOptimizer):
    """LAMB with ``apex.optimizers.FusedLAMB``'s signature (see the module docstring)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, amsgrad: bool = False, adam_w_mode: bool = True,
                 grad_averaging: bool = True, set_grad_none: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False) -> None:
        if amsgrad:
            raise SMPConfigError.build("FusedLamb does not support the AMSGrad variant", True,
                                       "smp.optimizers.FusedLamb", "pass amsgrad=False")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb
        self._grad_norm: GradNormFn = local_grad_norm

    def set_grad_norm_fn(self, fn: GradNormFn) -> None:
        """Compute step 1's norm with ``fn(params)`` (``smp.DistributedOptimizer`` passes
        the global norm over every pipeline and tensor-parallel rank)."""
        self._grad_norm = fn

    def _update(self) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        max_norm = float(self.defaults["max_grad_norm"])
        norm = self._grad_norm(params).to(torch.float32)
        clip = torch.where(norm > max_norm, norm / max_norm, torch.ones_like(norm)) \
            if max_norm > 0 else torch.ones_like(norm)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            self._update_group(group, clip)

    def _update_group(self, group: dict[str, Any], clip: torch.Tensor) -> None:
        beta3 = 1 - group["betas"][0] if group["grad_averaging"] else 1.0
        decay, lr = group["weight_decay"], group["lr"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad.float() / clip.to(p.device)
            p32, update = self._adam_direction(p, g, group, beta3, self.adam_w_mode)
            ratio = torch.tensor(lr, dtype=torch.float32, device=p.device)
            if self.use_nvlamb or decay != 0:
                pn = torch.linalg.vector_norm(p32)
                un = torch.linalg.vector_norm(update)
                ratio = torch.where((pn != 0) & (un != 0), lr * pn / un, ratio)
            p.copy_(p32 - ratio * update)
