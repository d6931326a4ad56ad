"""The arithmetic the calibration fits share: a two-unknown least squares in closed form
(which says plainly when two columns cannot be told apart), and limits.
"""

from __future__ import annotations

Row = tuple[float, float, float]
"""(a, b, r): one observation of r = a x + b y."""


def least_squares(rows: list[Row]) -> tuple[float, float] | None:
    """(x, y) minimising the sum of (a x + b y - r)^2 over ``rows``; None when the columns are
    proportional.

    >>> least_squares([(1.0, 0.0, 2.0), (0.0, 1.0, 3.0), (1.0, 1.0, 5.0)])
    (2.0, 3.0)
    """
    aa = sum(a * a for a, _, _ in rows)
    bb = sum(b * b for _, b, _ in rows)
    ab = sum(a * b for a, b, _ in rows)
    ar = sum(a * r for a, _, r in rows)
    br = sum(b * r for _, b, r in rows)
    det = aa * bb - ab * ab
    if not det > 0:
        return None
    return (ar * bb - br * ab) / det, (br * aa - ar * ab) / det


def clamp(value: float, limits: tuple[float, float]) -> float:
    """``value`` held inside ``limits``: a fit beyond them is a broken measurement.

    >>> clamp(9.0, (0.25, 8.0)), clamp(0.1, (0.25, 8.0)), clamp(1.5, (0.25, 8.0))
    (8.0, 0.25, 1.5)
    """
    lo, hi = limits
    return min(max(value, lo), hi)
