"""Refitting a cluster spec's efficiency factors on a measured run: the numbers.

Why: a spec from datasheets or a calibration on another host prices a user's cluster with
factors it never saw; one measured step (``cost_model.measurement``) shows them. Each factor
is refit from the actions that show it, priced at the measured run's own configuration:

- ``compute_scale`` / ``overhead_scale`` (a node's work / fixed cost), and with them the
  runtime's ``microbatch_overhead_s`` where the two cannot be told apart: from each
  pipeline rank's forward and backward, least squares of relative errors (``fit_scales``);
- ``message_overhead_s``: the measured time to post one pipeline send;
- the links' bandwidth: from the data-parallel reduction left exposed (``solve_monotone``);
- ``step_overhead_s``: what the measured step holds beyond all of these (the script's own
  work between steps among it).

The planner prices the rows (``smp_fx.planner.measured``); see docs/planning.md, 'Learning
from a measured run'.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cost_model.cluster import ClusterSpec

log = logging.getLogger(__name__)

SEPARABLE = 1e-3
"""Below this |det| of the normalised 2x2 system, work and fixed cost cannot be told apart."""


Observation = tuple[float, float, float]
"""(a, b, r): one observation of r = a x + b y."""


def least_squares(rows: Sequence[Observation]) -> tuple[float, float] | None:
    """(x, y) minimising the sum of (a x + b y - r)^2 over ``rows``; None when the columns are
    proportional (the calibration's fits share it).

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


@dataclass(frozen=True)
class Row:
    """One measured action against its prediction split by what each factor scales."""

    what: str
    measured: float
    work: float
    """Seconds that scale with ``compute_scale``."""
    fixed: float
    """Seconds that scale with ``overhead_scale``."""
    runtime: float
    """Seconds that scale with ``microbatch_overhead_s`` (the runtime per action)."""
    other: float
    """The rest (tensor-parallel collectives)."""


@dataclass(frozen=True)
class Moved:
    """One factor's refit: before, after, and the measured actions it came from."""

    factor: str
    before: float
    after: float
    source: str


def fit_scales(rows: Sequence[Row]) -> tuple[float, float, float, str]:
    """Multipliers (a, b, c) of work, fixed cost and the runtime's cost per action
    minimising the relative errors ``(a work + b fixed + c runtime + other) / measured - 1``:
    first a and b (c = 1); when the rows cannot tell work from fixed cost or a multiplier
    comes out <= 0, one common multiplier of all three, and the reason."""
    use = [r for r in rows if r.measured > 0 and r.work + r.fixed > 0]
    if not use:
        return 1.0, 1.0, 1.0, "no measured forward or backward: compute factors kept"
    xs = [(r.work / r.measured, r.fixed / r.measured,
           1.0 - (r.runtime + r.other) / r.measured) for r in use]
    solved = least_squares(xs) if _separable(xs) else None
    if solved is not None and min(solved) > 0:
        return solved[0], solved[1], 1.0, ""
    if solved is not None:
        why = (f"the two-factor fit gave work x{solved[0]:.3g}, fixed cost x{solved[1]:.3g} "
               "(not both > 0): one common multiplier of work, fixed cost and the runtime "
               "per action")
    else:
        why = ("work and fixed cost take the same share of every measured action: one "
               "common multiplier of them and the runtime per action")
    own = [((r.work + r.fixed + r.runtime) / r.measured, 1.0 - r.other / r.measured)
           for r in use]
    s = sum(x * y for x, y in own) / max(sum(x * x for x, _ in own), 1e-30)
    k = max(s, 1e-3)
    if s < k:
        why += f" (x{s:.3g} held at x{k:g}: the actions took less than their fixed part)"
    log.info("refit: %s (x%.3g)", why, k)
    return k, k, k, why


def _separable(xs: Sequence[Observation]) -> bool:
    """Whether the two columns point apart by more than ``SEPARABLE`` (1 - cos^2)."""
    ww, ff = sum(w * w for w, _, _ in xs), sum(f * f for _, f, _ in xs)
    wf = sum(w * f for w, f, _ in xs)
    return ww > 0 and ff > 0 and 1.0 - wf * wf / (ww * ff) > SEPARABLE


def solve_monotone(f: Callable[[float], float], target: float, lo: float = 1e-3,
                   hi: float = 1e3, steps: int = 40) -> float:
    """The ``x`` in [lo, hi] where the non-increasing ``f`` meets ``target`` (bisection in
    log x; an end when ``target`` lies beyond what ``f`` reaches there)."""
    if f(lo) <= target:
        return lo
    if f(hi) >= target:
        return hi
    a, b = math.log(lo), math.log(hi)
    for _ in range(steps):
        mid = (a + b) / 2
        if f(math.exp(mid)) > target:
            a = mid
        else:
            b = mid
    return math.exp((a + b) / 2)


def scaled(cluster: ClusterSpec, *, compute: float = 1.0, overhead: float = 1.0,
           runtime: float = 1.0, message_s: float | None = None, link: float = 1.0,
           step_s: float | None = None, source: str = "") -> ClusterSpec:
    """``cluster`` with its device's compute, fixed-cost and per-action factors multiplied,
    the links' bandwidth multiplied by ``link``, and the per-message and per-step costs set;
    ``source`` is written as where each changed figure comes from."""
    d = cluster.device
    changes: dict[str, Any] = {}
    if compute != 1.0:
        changes["compute_scale"] = d.compute_scale * compute
    if overhead != 1.0:
        changes["overhead_scale"] = d.overhead_scale * overhead
    if runtime != 1.0:
        changes["microbatch_overhead_s"] = d.microbatch_overhead_s * runtime
    if message_s is not None:
        changes["message_overhead_s"] = message_s
    if step_s is not None:
        changes["step_overhead_s"] = step_s
    device = dataclasses.replace(d, **changes) if changes else d
    if changes and source:
        device = device.with_sources(**dict.fromkeys(changes, source))
    out = dataclasses.replace(cluster, device=device)
    if link != 1.0:
        out = dataclasses.replace(out, intra_node_bandwidth=cluster.intra_node_bandwidth * link,
                                  inter_node_bandwidth=cluster.inter_node_bandwidth * link)
        if source:
            out = out.with_sources(intra_node_bandwidth=source, inter_node_bandwidth=source)
    return out


def format_moved(moved: Sequence[Moved]) -> str:
    """The table of moved factors: factor, before, after, ratio, from which actions."""
    def fmt(name: str, x: float) -> str:
        if name.endswith("_s"):
            return f"{x * 1e6:.1f} us" if x < 1e-3 else f"{x * 1e3:.2f} ms"
        if "bandwidth" in name:
            return f"{x / 1e9:.3g} GB/s"
        return f"{x:.3g}"

    rows = [("factor", "before", "after", "x", "from")]
    rows += [(m.factor, fmt(m.factor, m.before), fmt(m.factor, m.after),
              f"{m.after / m.before:.2f}" if m.before else "-", m.source) for m in moved]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  ----")
    return "\n".join(lines)


__all__ = ["Moved", "Observation", "Row", "fit_scales", "format_moved", "least_squares", "scaled",
           "solve_monotone"]
