"""A priced plan as the user sees it: the ``PLAN`` record, its JSON, and the comparisons.

``PlanRecord`` is the flat record ``smp-fx plan --json`` writes for every plan (the keys
the planning issue names, then ``tokens_per_s`` and a ``details`` object with the
communication times, the memory breakdown and the layers per pipeline rank); it
round-trips through JSON exactly. ``explain`` says why the best plan beats the runner-up
in the terms the step is made of.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cost_model.units import human_time
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.step import Priced

PLAN_KEYS = ("tp", "pp", "dp", "ep", "cp", "mbs", "microbatches", "vp", "schedule",
             "recompute", "sp", "zero", "step_time_s", "memory_bytes_per_gpu", "bubble_fraction",
             "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu")


def _r(x: float) -> float:
    return float(f"{float(x):.6g}")


@dataclass(frozen=True)
class PlanRecord:
    """One plan, as ``--json`` writes it (module docstring)."""

    tp: int
    pp: int
    dp: int
    mbs: int
    microbatches: int
    vp: int
    schedule: str
    recompute: str
    sp: bool
    zero: str
    step_time_s: float
    memory_bytes_per_gpu: int
    bubble_fraction: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    tokens_per_s: float = 0.0
    ep: int = 1
    cp: int = 1
    details: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.tp, self.pp, self.dp, self.mbs, self.vp, self.schedule,
                         self.recompute, self.sp, self.zero, self.ep, self.cp)

    def fix_text(self) -> str:
        """The ``--fix`` argument that prices exactly this plan again."""
        c = self.candidate
        return (f"tp={c.tp},pp={c.pp},dp={c.dp},mbs={c.mbs},vp={c.vp},schedule={c.schedule},"
                f"recompute={c.recompute},sp={str(c.sp).lower()},zero={c.zero},ep={c.ep},"
                f"cp={c.cp}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["details"] = dict(self.details)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanRecord:
        d = dict(data)
        d["details"] = dict(d.get("details", {}))
        return cls(**d)


def record(p: Priced, *, model_flops_per_sample: float, global_batch: int,
           tokens_per_sample: int, peak_flops: float, refused: str | None = None
           ) -> PlanRecord:
    """The record of a priced candidate; TFLOP/s per GPU counted as the model's FLOPs
    (forward and backward, once) and as the FLOPs the GPUs execute (recompute included);
    ``refused``: the rule by which ``smp.init`` refuses it (a what-if ``--fix`` priced)."""
    c = p.candidate
    gpus = c.gpus
    step = p.step_time_s
    model_tf = model_flops_per_sample * global_batch / (gpus * step) / 1e12
    hw_tf = p.hardware_flops / (gpus * step) / 1e12
    details = {
        "pipeline_s": _r(p.pipeline_s), "optimizer_s": _r(p.optimizer_s),
        "comm": {k: (_r(v) if isinstance(v, float) else v) for k, v in p.comm.to_json().items()},
        "memory": p.memory.to_json(), "memory_rank": p.memory_rank,
        "layers_per_rank": list(p.layers_per_rank),
    }
    if refused is not None:
        details["refused"] = refused
    return PlanRecord(c.tp, c.pp, c.dp, c.mbs, p.microbatches, c.vp, c.schedule, c.recompute,
                      c.sp, c.zero, _r(step), int(p.memory_bytes), _r(p.bubble_fraction),
                      _r(model_tf), _r(hw_tf), _r(model_tf * 1e12 / peak_flops),
                      _r(global_batch * tokens_per_sample / step), c.ep, c.cp, details)


def explain(best: Priced, runner: Priced) -> str:
    """Why ``best`` is faster than ``runner``: the step's parts that differ most."""
    gap = runner.step_time_s - best.step_time_s
    if gap <= 0:
        return "the two plans are predicted equally fast"
    diffs = {
        "pipeline compute and bubble": runner.pipeline_s - best.pipeline_s,
        "exposed data-parallel reduction": runner.comm.dp_exposed - best.comm.dp_exposed,
        "optimizer step": runner.optimizer_s - best.optimizer_s,
        "tied-weight reduction": runner.comm.tied - best.comm.tied,
    }
    ranked = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))
    parts = [f"{name} {'-' if d > 0 else '+'}{human_time(abs(d))}" for name, d in ranked[:2]
             if abs(d) > 1e-9]
    changes = [f"{k} {getattr(runner.candidate, k)} -> {getattr(best.candidate, k)}"
               for k in Candidate.__dataclass_fields__
               if getattr(runner.candidate, k) != getattr(best.candidate, k)]
    inside = (f"tensor-parallel communication {human_time(best.comm.tp)} vs "
              f"{human_time(runner.comm.tp)}, bubble {best.bubble_fraction:.1%} vs "
              f"{runner.bubble_fraction:.1%}")
    return (f"{human_time(gap)} ({gap / runner.step_time_s:.1%}) faster than the runner-up "
            f"({', '.join(changes) or 'same knobs'}): {'; '.join(parts)} "
            f"(within the pipeline: {inside})")


__all__ = ["PLAN_KEYS", "PlanRecord", "explain", "record"]
