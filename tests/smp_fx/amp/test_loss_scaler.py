"""Loss scalers: Megatron's dynamic-scaling rules and SMP's DistributedOptimizer arguments."""

from __future__ import annotations

import pytest

from smp_fx import SMPConfigError
from smp_fx.amp.loss_scaler import DynamicLossScaler, LossScaler, make_scaler


def _run(s: DynamicLossScaler, pattern: str) -> list[float]:
    out = []
    for c in pattern:
        s.update_scale(c == "x")
        out.append(s.loss_scale)
    return out


def test_dynamic_scaling_rules() -> None:
    assert DynamicLossScaler().loss_scale == 2.0**32  # SMP's defaults
    assert _run(DynamicLossScaler(16.0, scale_window=2), "x..x...") == \
        [8.0, 8.0, 16.0, 8.0, 8.0, 16.0, 16.0]
    assert _run(DynamicLossScaler(4.0, min_scale=2.0), "xxx") == [2.0, 2.0, 2.0]
    # delayed_shift: the scale drops on the 2nd overflow; hysteresis refills when it grows
    assert _run(DynamicLossScaler(16.0, scale_window=3, delayed_shift=2), "xx...x") == \
        [16.0, 8.0, 8.0, 8.0, 16.0, 16.0]
    # consecutive_hysteresis: any good step refills it
    assert _run(DynamicLossScaler(16.0, scale_window=9, delayed_shift=2,
                                  consecutive_hysteresis=True), "x.x.x") == [16.0] * 5
    assert _run(DynamicLossScaler(16.0, scale_window=9, delayed_shift=2), "x.x.x") == \
        [16.0, 16.0, 8.0, 8.0, 4.0]


def test_state_round_trip() -> None:
    a = DynamicLossScaler(16.0, scale_window=2, delayed_shift=2)
    _run(a, "x.x..")
    b = DynamicLossScaler(16.0, scale_window=2, delayed_shift=2)
    b.load_state_dict(a.state_dict())
    assert _run(a, "x.x.") == _run(b, "x.x.")


def test_optimizer_arguments() -> None:
    assert isinstance(make_scaler(128.0, False, {}), LossScaler)
    assert make_scaler(None, False, {}).loss_scale == 1.0
    s = make_scaler(None, True, {"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})
    assert isinstance(s, DynamicLossScaler) and s.delayed_shift == 2
    with pytest.raises(SMPConfigError, match="unknown dynamic_loss_args"):
        make_scaler(None, True, {"init_scal": 2.0})
    with pytest.raises(SMPConfigError, match="dynamic_loss_scale=True"):
        make_scaler(None, False, {"init_scale": 2.0})
    with pytest.raises(SMPConfigError, match="scale_factor"):
        DynamicLossScaler(scale_factor=1.0)
