"""The arithmetic the calibration fits share: a two-unknown least squares in closed form
(``cost_model.refit``'s, which the refit on measured runs uses too; it says plainly when
two columns cannot be told apart), and limits.
"""

from __future__ import annotations

from cost_model.refit import Observation as Row
from cost_model.refit import least_squares

__all__ = ["Row", "clamp", "least_squares"]


def clamp(value: float, limits: tuple[float, float]) -> float:
    """``value`` held inside ``limits``: a fit beyond them is a broken measurement.

    >>> clamp(9.0, (0.25, 8.0)), clamp(0.1, (0.25, 8.0)), clamp(1.5, (0.25, 8.0))
    (8.0, 0.25, 1.5)
    """
    lo, hi = limits
    return min(max(value, lo), hi)
