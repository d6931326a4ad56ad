"""The arithmetic the calibration fits share: a two-unknown least squares, and holding a
fitted figure inside its limits.

Why closed form: every fit here is linear in two figures (fixed costs and work, or the
cost per message and the pipelined scale), over three to six rows; the 2 x 2 normal
equations say plainly when the two columns cannot be told apart (``None``).
"""

from __future__ import annotations

Row = tuple[float, float, float]
"""(a, b, r): one observation of r = a x + b y."""


def least_squares(rows: list[Row]) -> tuple[float, float] | None:
    """(x, y) minimising the sum of (a x + b y - r)^2 over ``rows`` of (a, b, r); None when
    the two columns are proportional.

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
    """``value`` held inside ``limits`` (lo, hi): a fit beyond them is taken for a broken
    measurement, and the limit is the figure the spec keeps.

    >>> clamp(9.0, (0.25, 8.0)), clamp(0.1, (0.25, 8.0)), clamp(1.5, (0.25, 8.0))
    (8.0, 0.25, 1.5)
    """
    lo, hi = limits
    return min(max(value, lo), hi)
