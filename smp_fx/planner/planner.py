"""``plan``: the one entry of the cluster planner (the CLI and the benchmarks call it).

A prepared model (``smp_fx.planner.model.prepare``) and a ``Setting`` (cluster, GPU count,
global batch, precision) in; the ranked plans that fit out, as ``PlanRecord``s with the
reason the best beats the runner-up. A search that finds no plan that fits is an error
that says how much memory the smallest candidate needs and what would make it fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cost_model.errors import SMPConfigError, SMPInternalError
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.model import Prepared, Profiler
from smp_fx.planner.overlap import MEGATRON_CORE
from smp_fx.planner.result import PlanRecord, explain, record
from smp_fx.planner.search import Allowed, Progress, SearchResult, check_fixed, search
from smp_fx.planner.stages import Ranks, rank_loads
from smp_fx.planner.step import Priced, Setting, model_flops

GiB = 1024**3


@dataclass
class Planned:
    """The search's outcome: ranked records (best first), the search itself, the reason."""

    records: list[PlanRecord]
    result: SearchResult
    reason: str
    model_flops_per_sample: float
    profiler: Profiler
    setting: Setting

    @property
    def best(self) -> PlanRecord:
        return self.records[0]

    def ranks(self, c: Candidate) -> Ranks:
        """What each pipeline rank of candidate ``c`` holds (for the timeline)."""
        prof = self.profiler(c.mbs, c.tp, c.sp)
        out = rank_loads(prof, c.recompute, c.pp, c.vp, c.schedule,
                         self.setting.cluster.device, self.setting.compute_factor,
                         self.setting.runtime == MEGATRON_CORE, self.setting.split_ends)
        assert out is not None
        return out


def plan(prepared: Prepared, setting: Setting, *, fixed: Mapping[str, Any] | None = None,
         allowed: Allowed | None = None, top_k: int = 5, max_mbs: int = 64,
         profiler: Profiler | None = None, progress: Progress | None = None) -> Planned:
    """Search and rank (``smp_fx.planner.search``); raise when nothing fits (module doc)."""
    fixed = dict(fixed or {})
    check_fixed(fixed, setting.gpus, setting.global_batch, prepared.info.layers)
    prof = profiler or Profiler(prepared, setting.cluster, runtime=setting.runtime,
                                fp8=setting.fp8)
    if prof.fp8 != setting.fp8:
        raise SMPInternalError.build("a profiler prices FP8 linears as its setting does",
                                     prof.fp8, "smp_fx.planner.planner.plan",
                                     "make the Profiler with fp8=setting.fp8")
    result = search(prof, setting, fixed=fixed, allowed=allowed, top_k=top_k,
                    max_mbs=max_mbs, progress=progress)
    if not result.ranked:
        raise no_plan(result, setting, fixed)
    flops = model_flops(prof(1, 1, False))
    peak = setting.cluster.device.peak_flops(
        "float8" if setting.fp8 else "float32" if setting.precision == "fp32" else "bfloat16")
    records = [record(p, model_flops_per_sample=flops, global_batch=setting.global_batch,
                      tokens_per_sample=prepared.info.tokens_per_sample, peak_flops=peak,
                      refused=result.what_if.get(p.candidate))
               for p in result.ranked]
    reason = explain(result.ranked[0], result.ranked[1]) if len(result.ranked) > 1 else \
        "the only candidate that fits"
    return Planned(records, result, reason, flops, prof, setting)


def no_plan(result: SearchResult, setting: Setting, fixed: Mapping[str, Any]) -> SMPConfigError:
    """The error for a search without a fitting plan (module docstring)."""
    usable = setting.cluster.usable_memory_bytes
    if result.smallest is None:
        reasons = "; ".join(f"{why} (x{n})" for why, n in sorted(
            result.refused.items(), key=lambda kv: -kv[1])[:3]) or "no candidate in the space"
        return SMPConfigError.build("no configuration can be priced", reasons,
                                    f"{setting.gpus} GPUs, global batch "
                                    f"{setting.global_batch}, --fix {dict(fixed)}",
                                    "relax --fix, or change --gpus / --global-batch")
    small: Priced = result.smallest
    need = small.memory_bytes
    hints = []
    if small.candidate.recompute != "full":
        hints.append("recompute=full")
    if small.candidate.zero == "none" and small.candidate.dp > 1:
        hints.append("zero=zero1 or fsdp")
    if small.candidate.mbs > 1:
        hints.append("a smaller microbatch")
    hints.append(f"more GPUs (memory per GPU shrinks with tp x pp) or a GPU with at least "
                 f"{need / GiB + (setting.cluster.device.memory_bytes - usable) / GiB:.1f} GiB")
    return SMPConfigError.build(
        "no plan fits in GPU memory",
        f"the smallest, {small.candidate.label()}, needs {need / GiB:.2f} GiB per GPU; "
        f"{usable / GiB:.2f} GiB are usable ({setting.cluster.name})",
        f"{setting.gpus} GPUs, global batch {setting.global_batch}"
        + (f", --fix {dict(fixed)}" if fixed else ""),
        "try " + ", ".join(hints))


__all__ = ["Planned", "no_plan", "plan"]
