"""fp16 training as SMP's ``"fp16": true`` does it: Megatron's ``FP16_Module`` and
``FP16_Optimizer`` semantics on top of the pipeline.

Every parameter gets an fp32 master, so the model's gradients are never modified and
preparing master gradients may run twice without unscaling twice.
See docs/precision.md, 'fp16'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from smp_fx.amp.loss_scaler import LossScaler, agree_found_inf

HALF = torch.float16


def training_dtype(cfg: Any) -> torch.dtype | None:
    """The half type the configuration trains in: fp16 (``"fp16": true``), bf16
    (``"bf16": true``: the same scheme, bf16 weights and fp32 masters, without loss
    scaling, as SMP's bf16 training), or None."""
    if cfg is None:
        return None
    return HALF if cfg.fp16 else torch.bfloat16 if cfg.bf16 else None


def half_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype = HALF
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """fp32 tensors among the model inputs, in half precision (integer inputs untouched)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.dtype == torch.float32 else t
    return pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))


def float_outputs(outputs: Any, dtype: torch.dtype = HALF) -> Any:
    """Half tensors among the model outputs, in fp32 (autograd flows through the cast)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype == dtype else t
    return pytree.tree_map_only(torch.Tensor, cast, outputs)


class MasterWeights:
    """fp32 masters of ``optimizer``'s parameters, swapped into its param groups; its state
    moves onto them by position, as Megatron's ``FP16_Optimizer`` does."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: LossScaler) -> None:
        self.scaler = scaler
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        saved = optimizer.state_dict()
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                master = torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
                self.pairs.append((p, master))
                masters.append(master)
            group["params"] = masters
        optimizer.load_state_dict(saved)
        self.model_of = {id(m): p for p, m in self.pairs}
        self.overflow = False
        self._stale = True

    def mark_stale(self) -> None:
        """The model's gradients changed: prepare the master gradients again."""
        self._stale = True

    def prepare(self) -> bool:
        """Master gradients from the model's (unscaled); True if any rank overflowed. Once per
        step however often asked; a collective when it runs."""
        if not self._stale:
            return self.overflow
        grads: list[torch.Tensor] = []
        for p, master in self.pairs:
            if p.grad is None:
                master.grad = None
                continue
            master.grad = p.grad.detach().to(torch.float32, copy=True)
            grads.append(master.grad)
        device = grads[0].device if grads else (
            self.pairs[0][1].device if self.pairs else torch.device("cpu"))
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), 1.0 / self.scaler.loss_scale, dtype=torch.float32,
                         device=device)
        # a sharded (FSDP2) gradient is checked and unscaled in its local shard
        grads = [getattr(g, "_local_tensor", g) for g in grads]
        for dev, on_dev in _by_device(grads).items():
            f = found if dev == device else torch.zeros_like(found, device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(on_dev, f, inv.to(dev))
            if f is not found:
                found = torch.maximum(found, f.to(device))
        agree_found_inf(found)
        self.overflow = bool(found.item() > 0)
        self._stale = False
        return self.overflow

    def masters_to_model(self) -> None:
        """Copy the stepped masters into the model's (half) parameters."""
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(master)

    def models_to_masters(self) -> None:
        """Masters from the model's parameters (after the model's weights were loaded)."""
        with torch.no_grad():
            for p, master in self.pairs:
                master.copy_(p)

    def zero_grad(self) -> None:
        for _, master in self.pairs:
            master.grad = None
        self._stale = True


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out
