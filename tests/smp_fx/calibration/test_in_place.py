"""The in-place factors (``smp_fx.calibration.in_place``): fitted back from known factors,
and on this CPU either equal to what the measurement implies or at the limit it lies
beyond."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from cost_model.device import DeviceSpec
from cost_model.devices import A100
from passes import meta
from passes.pipeline import analyse
from passes.trace import trace
from smp_fx.calibration import in_place
from smp_fx.calibration import reference as ref

CPU = torch.device("cpu")
CONV_SPEC = dataclasses.replace(A100, op_overheads=(("default", 5e-6, 8e-6),
                                                    ("conv", 40e-6, 120e-6)))


def test_scales_fit_recovers_fixed_and_work_factors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured = 2.5 x predicted fixed costs + 1.2 x predicted work at each reference size
    is fitted back to (2.5, 1.2); absurd fits are clamped to the limits."""
    rows = {(1, 8): (4e-4, 2e-4), (2, 16): (4e-4, 9e-4), (ref.BATCH, ref.SEQ): (4e-4, 6e-3)}

    def fake(spec: object, device: object, batch: int, tokens: int, repeats: int
             ) -> tuple[float, float, float]:
        fixed, work = rows[batch, tokens]
        return fixed, work, 2.5 * fixed + 1.2 * work

    monkeypatch.setattr(in_place, "_size_row", fake)
    assert in_place.fit_scales(A100, CPU) == (pytest.approx(2.5), pytest.approx(1.2))
    rows = {k: (f, w * 100) for k, (f, w) in rows.items()}
    monkeypatch.setattr(in_place, "_size_row", lambda s, d, b, t, r: (*rows[b, t], 1e-9))
    assert in_place.fit_scales(A100, CPU) == in_place.LIMITS[:1] * 2


def _conv_prediction() -> Callable[[float], float]:
    """``ConvReference``'s predicted forward and backward with the convolutions' fixed
    costs times a factor: the cost model's own sum, written here apart from the fit."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ref.ConvReference()
        x = torch.randn(*ref.CONV_INPUT)
    traced = trace(model, (x,), {})

    def predicted(factor: float) -> float:
        ops = tuple((k, f * factor, b * factor) if k == "conv" else (k, f, b)
                    for k, f, b in CONV_SPEC.op_overheads)
        spec: DeviceSpec = dataclasses.replace(CONV_SPEC, op_overheads=ops)
        costed = analyse(model, (x,), traced=traced, device=spec)
        costs = [meta.COST.get(n) for n in costed.graph.nodes]
        return sum(c.fwd_time_s + c.bwd_time_s for c in costs if c is not None)

    return predicted


def _fake_clock(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every timed forward and backward takes ``seconds`` by the clock."""
    ticks = iter([0.0, seconds] * 100)
    monkeypatch.setattr(in_place.microbench, "clock",
                        lambda device, ticks=ticks: lambda: next(ticks))


def test_conv_factor_recovers_the_factor_that_made_the_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A measured time equal to the prediction with the convolutions' fixed costs x 1.7
    is fitted back to 1.7 (strictly inside the limits); a measured time of nothing or of
    an hour is clamped to them; a spec that prices no convolution keeps 1.0."""
    predicted = _conv_prediction()
    _fake_clock(monkeypatch, predicted(1.7))
    assert in_place.fit_conv_scale(CONV_SPEC, CPU, repeats=3) == pytest.approx(1.7, rel=1e-9)
    lo, hi = in_place.LIMITS
    for seconds, limit in ((0.0, lo), (3600.0, hi)):
        _fake_clock(monkeypatch, seconds)
        assert in_place.fit_conv_scale(CONV_SPEC, CPU, repeats=3) == limit
    no_conv = dataclasses.replace(A100, op_overheads=(("default", 5e-6, 8e-6),))
    assert in_place.fit_conv_scale(no_conv, CPU, repeats=3) == 1.0


def test_conv_factor_on_this_cpu_makes_the_prediction_equal_the_measurement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured on this CPU: the fitted factor makes the prediction equal the measured
    time, or it is the limit the measurement lies beyond (this machine's load decides
    which)."""
    measured: list[float] = []
    real = in_place._measured

    def recorded(*args: object, **kwargs: object) -> float:
        measured.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return measured[-1]

    monkeypatch.setattr(in_place, "_measured", recorded)
    factor = in_place.fit_conv_scale(CONV_SPEC, CPU, repeats=3)
    predicted = _conv_prediction()
    lo, hi = in_place.LIMITS
    assert len(measured) == 1
    if factor == lo:
        assert predicted(lo) >= measured[0]
    elif factor == hi:
        assert predicted(hi) <= measured[0]
    else:
        assert lo < factor < hi
        assert predicted(factor) == pytest.approx(measured[0], rel=1e-6)
