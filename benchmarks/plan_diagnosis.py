"""Where each public run's predicted step goes: the rows of ``plan_validation.py`` taken apart.

Per row: predicted / published, then the step in shares: compute on the slowest rank
(its repeated layer's time by kind: GEMMs, attention, element-wise, tensor-parallel
communication), the pipeline bubble, exposed tp / cp / ep / dp communication, the
recompute forward and the optimizer. What a miss is made of, to group the misses by cause.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_diagnosis.py [--rows ID,ID] [--gpu H100]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from plan_validation import Run, prepared_for, read_runs, setting_for  # noqa: E402

from cost_model.errors import SMPError  # noqa: E402
from cost_model.roofline import GEMM_KINDS, kind_of  # noqa: E402
from passes import meta  # noqa: E402
from passes.tensor_parallel.costs import COLLECTIVES  # noqa: E402
from smp_fx.planner.layers import KEPT  # noqa: E402
from smp_fx.planner.planner import Planned, plan  # noqa: E402
from smp_fx.planner.profile import split_parts  # noqa: E402
from smp_fx.planner.step import links, price  # noqa: E402


def layer_kinds(planned: Planned, mbs: int) -> dict[str, float]:
    """Shares of one repeated layer's time by kind (the tp 1 graph, ops one by one: before
    Megatron-Core's fused kernels replace an eager attention core or element-wise groups)."""
    prof = planned.profiler
    gm = prof.costed(mbs)
    parts = split_parts(gm, prof.prepared.repeats)
    nodes = parts[KEPT] if prof.prepared.repeats is not None else [
        n for p in parts for n in p]
    out: dict[str, float] = defaultdict(float)
    for n in nodes:
        c = meta.COST.get(n)
        if c is None:
            continue
        kind = kind_of(c.op)
        key = ("attention" if kind == "sdpa" or (kind in ("matmul", "bmm")
                                                  and not meta.PARAMS.get(n))
               else "gemm" if kind in GEMM_KINDS else
               "tp comm" if meta.TP.get(n) in COLLECTIVES else "elementwise")
        out[key] += c.fwd_time_s + c.bwd_time_s
    total = sum(out.values()) or 1.0
    return {k: v / total for k, v in sorted(out.items())}


def diagnose(run: Run) -> str:
    """One row: ratio and where its predicted step goes (module docstring)."""
    setting = setting_for(run)
    planned = plan(prepared_for(run), setting, fixed=run.fix(), top_k=1)
    best = planned.result.ranked[0]
    c = best.candidate
    ranks = planned.ranks(c)
    prof = planned.profiler(c.mbs, c.tp, c.sp)
    again = price(c, ranks, prof, setting)
    step = again.step_time_s
    m = again.microbatches
    pred = run.step_flops() / run.gpus / step / 1e12
    ratio = pred / run.tflops_per_gpu
    run_times = links(c, ranks, setting).times  # tp hidden where Megatron-Core hides it
    slow = max(range(c.pp), key=lambda r: run_times[r].total_s)
    per_mb = run_times[slow].total_s
    rc = 0.0
    if c.recompute != "none":
        layer = prof.parts[KEPT] if len(prof.parts) > KEPT else None
        if layer is not None:
            f_none, b_none = layer.times("none")
            f_rc, b_rc = layer.times(c.recompute)
            rc = ((f_rc + b_rc) - (f_none + b_none)) / max(f_rc + b_rc, 1e-30)
    tp_mb = ranks.tp_s[slow]
    compute = m * per_mb / c.cp if c.cp > 1 else m * per_mb
    bubble = again.bubble_fraction * again.pipeline_s
    cm = again.comm
    shares = {
        "compute": compute, "bubble": bubble, "cp": cm.cp, "ep": cm.ep,
        "dp exp": cm.dp_exposed, "fsdp exp": cm.fsdp_exposed, "opt": again.optimizer_s}
    kinds = layer_kinds(planned, c.mbs)
    head = (f"{run.id:<40} pub {run.tflops_per_gpu:6.1f} pred {pred:6.1f} ratio {ratio:5.3f}"
            f"  {c.label()}  step {step:.3f}s m={m}")
    body = "  ".join(f"{k} {v / step:5.1%}" for k, v in shares.items() if v > 0)
    lay = "  ".join(f"{k} {v:4.0%}" for k, v in kinds.items())
    tp_note = (f"tp comm {tp_mb / max(ranks.times[slow].total_s, 1e-30):4.0%} of rank time"
               f" ({'hidden' if setting.runtime == 'megatron-core' else 'exposed'})"
               if c.tp > 1 else "")
    rc_note = f"recompute {rc:4.0%} of layer" if rc else ""
    mem = f"mem {again.memory.total / 2**30:.1f} GiB"
    return f"{head}\n    {body}\n    layer: {lay}  {tp_note} {rc_note} {mem}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="")
    ap.add_argument("--gpu", default="")
    args = ap.parse_args(argv)
    for run in read_runs():
        if (args.rows and run.id not in args.rows.split(",")) or \
                (args.gpu and run.gpu != args.gpu) or run.fitted:
            continue
        try:
            print(diagnose(run), flush=True)
        except SMPError as exc:
            print(f"{run.id:<40} refused: {' '.join(str(exc).split())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
