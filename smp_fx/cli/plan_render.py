"""How ``smp-fx plan`` shows its plans: the table, the scaling curve, the timeline picture."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost_model.collectives import p2p_time
from cost_model.refit import format_moved
from cost_model.schedule import SCHEDULE_NAMES, generate
from cost_model.simulate import SimResult, StageCost, simulate
from cost_model.units import human_bytes, human_time
from smp_fx.cli.render import _table
from smp_fx.planner.measured import Refit
from smp_fx.planner.planner import Planned
from smp_fx.planner.result import PlanRecord
from smp_fx.planner.step import crosses_node

HEADER = ("#", "tp", "pp", "dp", "ep", "cp", "mbs", "m", "schedule", "v", "recompute", "sp",
          "zero",
          "step", "tokens/s", "TF/GPU model", "TF/GPU hw", "MFU", "mem/GPU", "bubble",
          "tp comm", "pp comm", "dp comm (exposed)", "ep a2a", "cp kv")
"""Communication per step on the busiest rank; dp comm is the gradient all-reduce (and
ZeRO-1's parameter broadcast), or FSDP's gathers and reduce-scatters; ep a2a the expert
dispatch's all-to-alls, cp kv context parallelism's K/V all-gathers and reduce-scatters."""


def _row(i: int, r: PlanRecord) -> list[str]:
    comm = r.details.get("comm", {})
    return [str(i), str(r.tp), str(r.pp), str(r.dp), str(r.ep), str(r.cp), str(r.mbs),
            str(r.microbatches),
            r.schedule, str(r.vp), r.recompute, "y" if r.sp else "-", r.zero,
            human_time(r.step_time_s), f"{r.tokens_per_s:,.0f}",
            f"{r.model_tflops_per_gpu:.1f}", f"{r.hardware_tflops_per_gpu:.1f}",
            f"{r.mfu:.1%}", human_bytes(r.memory_bytes_per_gpu), f"{r.bubble_fraction:.1%}",
            human_time(comm.get("tp_s", 0.0)), human_time(comm.get("pp_s", 0.0)),
            _dp_cell(r.zero, comm), human_time(comm.get("ep_s", 0.0)),
            human_time(comm.get("cp_s", 0.0))]


def _dp_cell(zero: str, comm: dict) -> str:
    if zero == "fsdp":
        return (f"{human_time(comm.get('fsdp_s', 0.0))} "
                f"({human_time(comm.get('fsdp_exposed_s', 0.0))})")
    total = comm.get("dp_s", 0.0) + comm.get("zero_s", 0.0)
    return f"{human_time(total)} ({human_time(comm.get('dp_exposed_s', 0.0))})"


def format_plans(planned: Planned) -> str:
    """The top plans, best first, then why the best wins and what the search did."""
    rows = [_row(i + 1, r) for i, r in enumerate(planned.records)]
    right = [True] * 8 + [False] + [True] + [False] * 3 + [True] * 12
    lines = _table(HEADER, rows, right)
    res, setting = planned.result, planned.setting
    best = planned.best
    mem = best.details.get("memory", {})
    lines += ["", f"best: {planned.reason}",
              "best's memory per GPU (rank " + str(best.details.get("memory_rank", 0)) + "): "
              + ", ".join(f"{k} {human_bytes(v)}" for k, v in mem.items() if k != "total")
              + f"; usable {human_bytes(setting.cluster.usable_memory_bytes)} of "
              f"{human_bytes(setting.cluster.device.memory_bytes)}",
              f"layers per pipeline rank: {best.details.get('layers_per_rank')}",
              f"searched {res.considered:,} candidates ({res.fitting:,} fit) with "
              f"{res.profiles} part pricings in {res.seconds:.1f} s"]
    if res.runtime_refused:
        lines.append(f"left out {res.runtime_refused:,} candidates with ep or cp > 1 that "
                     "smp.init refuses (smp_fx.config.combination_refusal)")
    for i, r in enumerate(planned.records):
        if "refused" in r.details:
            lines.append(f"#{i + 1} is a what-if (--fix): smp.init refuses it today: "
                         f"{r.details['refused']}")
    for why, n in sorted(res.refused.items(), key=lambda kv: -kv[1])[:4]:
        lines.append(f"left out: {why} ({n:,})")
    return "\n".join(lines)


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    record: PlanRecord
    gpu_hours: float


def format_refit(r: Refit) -> str:
    """The refit's moved factors, then each measured run's step before / after / measured."""
    lines = [f"refit on measured runs: {r.cluster.name}", format_moved(r.moved)]
    lines += [f"  note: {n}" for n in r.notes]
    for name, before, after, measured in r.checks:
        lines.append(f"{name} at its own configuration: predicted {before * 1e3:.2f} ms "
                     f"before, {after * 1e3:.2f} ms after; measured {measured * 1e3:.2f} ms")
    return "\n".join(lines) + "\n"


def format_scaling(points: Sequence[ScalePoint], tokens: float) -> str:
    header = ("GPUs", "best plan", "step", "tokens/s", "MFU", f"GPU-hours ({tokens:.3g} tok)")
    rows = [[str(p.gpus), p.record.candidate.label(), human_time(p.record.step_time_s),
             f"{p.record.tokens_per_s:,.0f}", f"{p.record.mfu:.1%}", f"{p.gpu_hours:,.0f}"]
            for p in points]
    return "\n".join(_table(header, rows, [True, False, True, True, True, True]))


def plot_scaling(points: Sequence[ScalePoint], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    gpus = [p.gpus for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, ys, label in ((axes[0], [p.record.tokens_per_s for p in points], "tokens/s"),
                          (axes[1], [100 * p.record.mfu for p in points], "MFU (%)"),
                          (axes[2], [p.gpu_hours for p in points], "GPU-hours")):
        ax.plot(gpus, ys, marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def simulate_best(planned: Planned) -> SimResult | None:
    """The best plan on the per-action simulator, when it has the schedule (v = 1,
    ``simple`` / ``interleaved``); None otherwise."""
    best = planned.best
    c = best.candidate
    if c.vp != 1 or (c.pp > 1 and c.schedule not in SCHEDULE_NAMES):
        return None
    ranks = planned.ranks(c)
    cluster = planned.setting.cluster
    fabric = cluster.fabric()
    send = [0.0] * c.pp
    back = [0.0] * c.pp
    latency = 0.0
    for i, (act, grad) in enumerate(ranks.hops):
        across = crosses_node(c, i, cluster.gpus_per_node)
        lat = fabric.inter_latency_s if across else fabric.intra_latency_s
        send[i] = p2p_time(act, fabric, across_nodes=across) - lat
        back[i + 1] = p2p_time(grad, fabric, across_nodes=across) - lat
        latency = max(latency, lat)
    costs = [StageCost(t.fwd_s, t.bwd_s, send[r], back[r], latency_s=latency)
             for r, t in enumerate(ranks.times)]
    name = c.schedule if c.pp > 1 else "interleaved"
    return simulate(generate(name, c.pp, best.microbatches), costs)


def timeline_note(planned: Planned) -> str:
    c = planned.best.candidate
    return (f"no timeline for {c.schedule} v={c.vp}: cost_model.simulate runs "
            f"{', '.join(SCHEDULE_NAMES)} at v = 1 (the step above is the closed form of "
            "cost_model.schedule_cost)")


def draw(planned: Planned, path: str, title: str) -> str | None:
    """Draw the best plan's simulated step; the reason when it cannot."""
    from smp_fx.cli.render import draw_timeline

    sim = simulate_best(planned)
    if sim is None:
        return timeline_note(planned)
    draw_timeline(sim, path, title + f" (simulated pipeline {human_time(sim.step_time_s)}, "
                  f"bubble {sim.bubble_fraction:.1%})")
    return None


__all__ = ["ScalePoint", "draw", "format_plans", "format_scaling", "plot_scaling",
           "simulate_best"]
