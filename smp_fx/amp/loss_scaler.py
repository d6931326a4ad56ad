"""Loss scalers for fp16 training, with Megatron's ``FP16_Optimizer`` semantics, and the
one place every rank agrees on an overflow (else stages would step different steps).
See docs/precision.md, 'fp16'.

>>> s = DynamicLossScaler(init_scale=8.0, scale_window=2)
>>> for overflow in (True, False, False, False):
...     s.update_scale(overflow)
>>> s.loss_scale
8.0
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPConfigError
from smp_fx.world import state

DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift",
                "consecutive_hysteresis")


class LossScaler:
    """A fixed loss scale (``static_loss_scale``); an overflow skips the step only."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """A static scale never changes."""

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_scale = float(sd["cur_scale"])


class DynamicLossScaler(LossScaler):
    """See the module docstring; the argument names and defaults are SMP's."""

    dynamic = True

    def __init__(self, init_scale: float = 2.0**32, scale_factor: float = 2.0,
                 scale_window: int = 1000, min_scale: float = 1.0, delayed_shift: int = 1,
                 consecutive_hysteresis: bool = False) -> None:
        super().__init__(init_scale)
        if scale_factor <= 1.0 or scale_window < 1 or delayed_shift < 1 or min_scale <= 0:
            raise SMPConfigError.build(
                "dynamic_loss_args need scale_factor > 1, scale_window >= 1, "
                "delayed_shift >= 1 and min_scale > 0",
                {"scale_factor": scale_factor, "scale_window": scale_window,
                 "delayed_shift": delayed_shift, "min_scale": min_scale},
                "smp.DistributedOptimizer", "use SMP's defaults (2.0, 1000, 1, 1)")
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cur_scale = float(sd["cur_scale"])
        self.cur_iter = int(sd.get("cur_iter", 0))
        self.last_overflow_iter = int(sd.get("last_overflow_iter", -1))
        self.cur_hysteresis = int(sd.get("cur_hysteresis", self.delayed_shift))


def make_scaler(static_loss_scale: float | None, dynamic_loss_scale: bool,
                dynamic_loss_args: dict[str, Any]) -> LossScaler:
    """The scaler ``smp.DistributedOptimizer(optimizer, static_loss_scale,
    dynamic_loss_scale, **dynamic_loss_args)`` asks for; unknown arguments are errors."""
    unknown = sorted(set(dynamic_loss_args) - set(DYNAMIC_ARGS))
    if unknown:
        raise SMPConfigError.build("unknown dynamic_loss_args", unknown,
                                   "smp.DistributedOptimizer", f"use only {DYNAMIC_ARGS}")
    if dynamic_loss_scale:
        return DynamicLossScaler(**dynamic_loss_args)
    if dynamic_loss_args:
        raise SMPConfigError.build("dynamic_loss_args need dynamic_loss_scale=True",
                                   sorted(dynamic_loss_args), "smp.DistributedOptimizer",
                                   "pass dynamic_loss_scale=True, or drop them")
    return LossScaler(1.0 if static_loss_scale is None else static_loss_scale)


def agree_found_inf(found_inf: torch.Tensor) -> torch.Tensor:
    """Max-reduce a found-inf flag over every rank, in place: a collective every rank calls
    once per step."""
    if state.is_initialized():
        st = state.get()
        if not st.in_process and st.world_size > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=st.group("world"))
    return found_inf
