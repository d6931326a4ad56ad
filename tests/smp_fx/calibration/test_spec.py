"""``smp_fx.calibration.spec``: the options, and a two-process calibration (the link, the
runtime on one stage, the cost per message and the pipelined scale at degree 2)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cost_model.device import DeviceSpec
from smp_fx.calibration.runtime_fit import PIPELINED_LIMITS
from smp_fx.calibration.spec import CalibrationOptions
from tests.helpers.dist import run_ranks


def test_options_time_fewer_steps_when_quick() -> None:
    assert CalibrationOptions(steps=12).timed_steps == 12
    assert CalibrationOptions(quick=True, steps=12).timed_steps == 8
    assert (CalibrationOptions().repeats, CalibrationOptions(quick=True).repeats) == (15, 5)


def _calibrate_two_ranks() -> dict[str, Any] | None:
    """One rank's calibration at world size 2; rank 0 returns the spec and what the
    pipelined fit was solved from (its rows and floor)."""
    from smp_fx.calibration import runtime_fit, spec

    seen: dict[str, Any] = {}
    solve = runtime_fit.solve_pipeline

    def recorded(rows: list[tuple[float, float, float]], floor: float) -> tuple[float, float]:
        seen.update(rows=rows, floor=floor)
        return solve(rows, floor)

    runtime_fit.solve_pipeline = recorded  # this rank's process only
    out = spec.calibrate(CalibrationOptions(quick=True, steps=3), world=2)
    return None if out is None else {"spec": out.to_json(), **seen}


def _pipelined_figures(rows: list[tuple[float, float, float]], floor: float
                       ) -> tuple[float, float]:
    """(per message, unclamped scale) solved apart from the library: numpy's least squares
    of the relative errors, the per-message cost held at ``floor`` when it falls below."""
    a = np.array(rows)
    (msg, extra), *_ = np.linalg.lstsq(a[:, :2], a[:, 2], rcond=None)
    if msg < floor:
        (extra,), *_ = np.linalg.lstsq(a[:, 1:2], a[:, 2] - a[:, 0] * floor, rcond=None)
        msg = floor
    return float(msg), 1.0 + float(extra)


@pytest.mark.multiproc
def test_two_processes_measure_the_link_and_fit_the_pipeline() -> None:
    """What ``smp-fx calibrate --nproc 2`` (or under ``smp-fx run -n 2``) runs on each rank:
    the link between the two, the runtime fitted on one stage by rank 0 alone, and the
    cost per message and the pipelined scale at pipeline degree 2, which are the least
    squares fit of the three measured runs (the scale within its limits: this machine's
    load may put it at one)."""
    first, second = run_ranks(_calibrate_two_ranks, 2, timeout=240)
    assert second is None and first is not None
    spec = DeviceSpec.from_json(first["spec"])
    assert "gloo between ranks 0 and 1" in spec.source("link_latency_s")
    assert spec.link_latency_s > 0 and spec.message_overhead_s > 0
    assert "one stage" in spec.source("step_overhead_s")
    assert "pipeline degree 2" in spec.source("message_overhead_s")
    assert "pipeline degree 2" in spec.source("pipelined_scale")
    assert len(first["rows"]) == 3  # the tiny model at two microbatch counts, the reference
    msg, scale = _pipelined_figures(first["rows"], first["floor"])
    lo, hi = PIPELINED_LIMITS
    assert spec.message_overhead_s == pytest.approx(msg, rel=1e-6)
    assert spec.pipelined_scale == pytest.approx(min(max(scale, lo), hi), rel=1e-6)
