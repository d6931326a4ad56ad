"""A cluster refitted on measured runs: each run priced at its own configuration, its actions
set against the prediction's parts, the factors refit (``cost_model.refit``).

Why here: the numbers are ``cost_model.refit``'s, but only the planner can price a measured
configuration and split each rank's predicted forward and backward into what each factor
scales. The split is exact, not estimated: a rank's time is linear in ``compute_scale``,
``overhead_scale``, ``microbatch_overhead_s`` and ``message_overhead_s``, so pricing with
each one moved gives its part.
See docs/planning.md, 'Learning from a measured run'.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cost_model.cluster import ClusterSpec
from cost_model.errors import SMPConfigError
from cost_model.measurement import Measurement
from cost_model.refit import Moved, Row, fit_scales, scaled, solve_monotone
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.model import Prepared, Profiler
from smp_fx.planner.profile import Profile
from smp_fx.planner.stages import Ranks, rank_loads
from smp_fx.planner.step import Priced, Setting, price

SettingOf = Callable[[ClusterSpec, int, int, str], Setting]
"""(cluster, processes, global batch, precision) -> the setting a plan is priced in."""
SENDS = ("SEND_ACT", "SEND_GRAD", "SEND_OUT")
BACKWARDS = ("B", "I", "W")
_DELTA_S = 1e-4  # the per-message cost moved by this much to find a rank's message count


@dataclass(frozen=True)
class Refit:
    """The refitted cluster, each factor's move, and each run's step before / after /
    measured at its own configuration."""

    cluster: ClusterSpec
    moved: tuple[Moved, ...]
    checks: tuple[tuple[str, float, float, float], ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"moved": [dataclasses.asdict(m) for m in self.moved],
                "checks": [{"file": f, "before_s": b, "after_s": a, "measured_s": m}
                           for f, b, a, m in self.checks], "notes": list(self.notes)}


@dataclass(frozen=True)
class _Priced:
    priced: Priced
    ranks: Ranks
    profile: Profile
    setting: Setting


def _price(prepared: Prepared, cluster: ClusterSpec, m: Measurement, name: str,
           setting_of: SettingOf) -> _Priced:
    """The measured configuration of ``m`` priced on ``cluster``, whatever its memory."""
    cfg = m.config
    c = Candidate(**cfg.fix())
    if c.gpus != cfg.world:
        raise SMPConfigError.build("a measured run is priced on tp x pp x dp processes",
                                   f"tp {c.tp} x pp {c.pp} x dp {c.dp} != {cfg.world}", name,
                                   "measure a run without context or expert parallelism")
    setting = setting_of(cluster, cfg.world, cfg.global_batch, cfg.precision)
    prof = Profiler(prepared, cluster)(c.mbs, c.tp, c.sp)
    ranks = rank_loads(prof, c.recompute, c.pp, c.vp, c.schedule, cluster.device,
                       setting.compute_factor)
    if ranks is None:
        raise SMPConfigError.build("the measured pipeline has more stages than the model "
                                   "has layers", f"pp {c.pp} x v {c.vp}", name,
                                   "measure the model given on the command line")
    return _Priced(price(c, ranks, prof, setting), ranks, prof, setting)


def rows(prepared: Prepared, cluster: ClusterSpec, m: Measurement, name: str,
         setting_of: SettingOf) -> list[Row]:
    """Each pipeline rank's forward and backward per microbatch, measured against the
    prediction split into work, fixed cost and the rest (module docstring)."""
    d = cluster.device

    def times(**change: Any) -> Ranks:
        spec = dataclasses.replace(d, **change) if change else d
        return _price(prepared, dataclasses.replace(cluster, device=spec), m, name,
                      setting_of).ranks

    base, work, fixed = times(), times(compute_scale=2 * d.compute_scale), times(
        overhead_scale=2 * d.overhead_scale)
    msg = times(message_overhead_s=d.message_overhead_s + _DELTA_S)
    act = times(microbatch_overhead_s=d.microbatch_overhead_s + _DELTA_S)
    measured = {"F": m.by_pp_rank("F"),
                "B": [sum(x) for x in zip(*(m.by_pp_rank(k) for k in BACKWARDS))]}
    out = []
    for r in range(m.config.pp):
        for kind, attr in (("F", "fwd_s"), ("B", "bwd_s")):
            t0 = getattr(base.times[r], attr)
            w = getattr(work.times[r], attr) - t0
            f = getattr(fixed.times[r], attr) - t0
            n = (getattr(msg.times[r], attr) - t0) / _DELTA_S
            runtime = (getattr(act.times[r], attr) - t0) / _DELTA_S * d.microbatch_overhead_s
            # the measured action holds no send: a message's cost is refit on its own
            out.append(Row(f"{kind} on pipeline rank {r} ({name})", measured[kind][r], w, f,
                           runtime, t0 - w - f - runtime - n * d.message_overhead_s))
    return out


def refit(prepared: Prepared, cluster: ClusterSpec,
          measured: Sequence[tuple[str, Measurement]], setting_of: SettingOf) -> Refit:
    """``cluster`` refitted on the ``measured`` runs ((file name, measurement)), in the
    order of ``cost_model.refit``'s module docstring."""
    d = cluster.device
    names = ", ".join(n for n, _ in measured)
    all_rows = [r for n, m in measured for r in rows(prepared, cluster, m, n, setting_of)]
    a, b, c, why = fit_scales(all_rows)
    notes = [why] if why else []
    per_send = [m.per_op(SENDS) for _, m in measured if m.config.pp > 1]
    per_send = [x for x in per_send if x > 0]
    message = statistics.median(per_send) if per_send else None
    source = f"refit by smp-fx plan --measured {names}"
    c1 = scaled(cluster, compute=a, overhead=b, runtime=c, message_s=message, source=source)
    links = []
    for name, m in measured:
        if m.config.dp < 2 or m.config.zero == "fsdp":
            continue
        target = statistics.median(rf.reducing_s for rf in m.ranks)
        p = _price(prepared, c1, m, name, setting_of)

        def exposed(k: float, p: _Priced = p) -> float:
            cl = scaled(c1, link=k)
            setting = dataclasses.replace(p.setting, cluster=cl)
            return price(p.priced.candidate, p.ranks, p.profile, setting).comm.dp_exposed

        links.append((solve_monotone(exposed, target), target, exposed(1.0)))
    k = statistics.geometric_mean([x for x, _, _ in links]) if links else 1.0
    c2 = scaled(c1, link=k, source=source)
    residuals = [m.step_time_s - _price(prepared, c2, m, n, setting_of).priced.step_time_s
                 for n, m in measured]
    step = d.step_overhead_s + statistics.fmean(residuals)
    if step < 0:
        notes.append(f"the measured steps are {-step * 1e3:.2f} ms shorter than priced with "
                     "the factors refit: the step's fixed cost set to 0, the gap left")
    c3 = scaled(c2, step_s=max(step, 0.0), source=source)
    fb = f"F, B on {len(all_rows) // 2} pipeline rank(s) of {names}"
    moved = [Moved("compute_scale", d.compute_scale, c3.device.compute_scale, fb),
             Moved("overhead_scale", d.overhead_scale, c3.device.overhead_scale, fb)]
    if c != 1.0:
        moved.append(Moved("microbatch_overhead_s", d.microbatch_overhead_s,
                           c3.device.microbatch_overhead_s, fb))
    if message is not None:
        moved.append(Moved("message_overhead_s", d.message_overhead_s, message,
                           f"median of the pipeline sends ({', '.join(SENDS)})"))
    if links:
        told = "; ".join(f"exposed {t * 1e3:.2f} ms measured vs {e * 1e3:.2f} ms priced"
                         for _, t, e in links)
        moved.append(Moved("intra_node_bandwidth", cluster.intra_node_bandwidth,
                           c3.intra_node_bandwidth, f"the data-parallel reduction ({told})"))
    moved.append(Moved("step_overhead_s", d.step_overhead_s, c3.device.step_overhead_s,
                       "what the measured step holds beyond the above (the script between "
                       "steps among it)"))
    checks = tuple((n, _price(prepared, cluster, m, n, setting_of).priced.step_time_s,
                    _price(prepared, c3, m, n, setting_of).priced.step_time_s, m.step_time_s)
                   for n, m in measured)
    return Refit(c3, tuple(moved), checks, tuple(notes))


__all__ = ["Refit", "SettingOf", "refit", "rows"]
