"""The arithmetic the calibration fits share (``smp_fx.calibration.solve``)."""

from __future__ import annotations

import pytest

from smp_fx.calibration.solve import clamp, least_squares


def test_least_squares_solves_both_figures() -> None:
    """Rows (d/d per-message, d/d scale, residual) made from known figures give them back."""
    rows = [(a, b, a * 1.5e-4 + b * 0.3) for a, b in ((4000.0, 0.1), (9000.0, 0.2),
                                                       (300.0, 0.9))]
    assert least_squares(rows) == (pytest.approx(1.5e-4), pytest.approx(0.3))
    assert least_squares([(1.0, 2.0, 3.0), (2.0, 4.0, 1.0)]) is None  # proportional


def test_clamp_holds_a_value_inside_its_limits() -> None:
    assert clamp(3.0, (0.5, 4.0)) == 3.0
    assert clamp(-1.0, (0.5, 4.0)) == 0.5 and clamp(9.0, (0.5, 4.0)) == 4.0
