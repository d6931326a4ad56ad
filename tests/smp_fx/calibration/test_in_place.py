"""The in-place factors (``smp_fx.calibration.in_place``): fitted back from known factors,
and on this CPU either equal to what the measurement implies or at the limit it lies
beyond."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

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


def _conv_prediction(base: DeviceSpec = CONV_SPEC) -> Callable[[float], float]:
    """``ConvReference``'s predicted forward and backward under ``base`` with the
    convolutions' fixed costs times a factor: the cost model's own sum, written here apart
    from the fit."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ref.ConvReference()
        x = torch.randn(*ref.CONV_INPUT)
    traced = trace(model, (x,), {})

    def predicted(factor: float) -> float:
        ops = tuple((k, f * factor, b * factor) if k == "conv" else (k, f, b)
                    for k, f, b in base.op_overheads)
        spec: DeviceSpec = dataclasses.replace(base, op_overheads=ops)
        costed = analyse(model, (x,), traced=traced, device=spec)
        costs = [meta.COST.get(n) for n in costed.graph.nodes]
        return sum(c.fwd_time_s + c.bwd_time_s for c in costs if c is not None)

    return predicted


def _spec_for_this_cpu() -> DeviceSpec:
    """``CONV_SPEC`` with the convolutions' fixed costs set to about half of what this CPU
    takes beyond the rest (one forward and backward timed here first), so that the fit
    on this CPU lands inside the limits, near 2."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ref.ConvReference()
        x = torch.randn(*ref.CONV_INPUT)
        grad = torch.randn_like(model(x))
    first = in_place._measured(model, x, grad, CPU, 3)
    predicted = _conv_prediction()
    rest, conv = predicted(0.0), predicted(1.0) - predicted(0.0)
    k = max(first - rest, rest) / (2 * conv)
    return dataclasses.replace(CONV_SPEC, op_overheads=tuple(
        (name, f * k, b * k) if name == "conv" else (name, f, b)
        for name, f, b in CONV_SPEC.op_overheads))


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


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, as calibration runs: its clock is then this process's CPU time,
    which other work on the machine hardly moves."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_conv_factor_on_this_cpu_makes_the_prediction_equal_the_measurement(
        monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """Measured on this CPU (with a spec made to land near 2 here): the fitted factor makes
    the prediction equal the measured time; only if this CPU's time moved fourfold since
    the spec was made may it be the limit the measurement lies beyond."""
    spec = _spec_for_this_cpu()
    measured: list[float] = []
    real = in_place._measured

    def recorded(*args: Any, **kwargs: Any) -> float:
        measured.append(real(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(in_place, "_measured", recorded)
    factor = in_place.fit_conv_scale(spec, CPU, repeats=3)
    predicted = _conv_prediction(spec)
    lo, hi = in_place.LIMITS
    assert len(measured) == 1
    if factor == lo:
        assert predicted(lo) >= measured[0]
    elif factor == hi:
        assert predicted(hi) <= measured[0]
    else:
        assert lo < factor < hi
        assert predicted(factor) == pytest.approx(measured[0], rel=1e-6)
