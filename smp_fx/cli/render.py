"""Ways to look at a ``PartitionPlan``: a text table, Graphviz dot, a timeline picture.

Kept apart from the command (``smp_fx.cli.partition``) so tests and notebooks can render a
plan without argument parsing. Everything here only reads the plan (and the graph for dot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx

from cost_model.simulate import FORWARD, SimResult
from cost_model.units import human_bytes, human_count, human_time
from passes import meta
from passes.plan import PartitionPlan, summarise_modules
from passes.tensor_parallel import TensorParallelPlan
from passes.tensor_parallel.coverage import coverage

# one fill colour per stage (colour-blind safe Okabe-Ito palette, cycled)
STAGE_COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00",
                 "#CC79A7", "#999999")


def _modules_cell(modules: Sequence[str], width: int = 36) -> str:
    text = ", ".join(modules) or "-"
    return text if len(text) <= width else text[: width - 3] + "..."


def _table(header: Sequence[str], rows: Sequence[Sequence[str]],
           right: Sequence[bool]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w)
                         for c, w, r in zip(cells, widths, right)).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def shape_words(plan: PartitionPlan) -> str:
    """``4 stages``, ``4 ranks x 2 chunks`` when each rank holds several, or ``3 chunks on
    2 ranks`` when a manual partition gives ranks different numbers."""
    v = plan.config.virtual_stages
    if not plan.placement:
        return f"{len(plan.stages)} stages"
    if len(plan.stages) == plan.num_ranks * v:
        return f"{plan.num_ranks} ranks x {v} chunks"
    return f"{len(plan.stages)} chunks on {plan.num_ranks} ranks"


def summary_line(plan: PartitionPlan) -> str:
    """Objective, lower bound, their ratio, predicted step time and bubble, on one line
    (with the papers' bubble rate, idle over ideal, for the smp-fx schedules)."""
    c = plan.config
    rate = f" (rate {plan.bubble_rate:.1%})" if plan.ranks else ""
    return (f"objective {plan.objective:.4f}  lower bound {plan.lower_bound:.4f}  "
            f"ratio {plan.ratio:.3f}  step {human_time(plan.step_time_s)} "
            f"({c.pipeline}, {c.microbatches} microbatches)  bubble {plan.bubble_fraction:.1%}"
            f"{rate}")


def format_ranks(plan: PartitionPlan) -> list[str]:
    """One row per rank: its chunks, their time, and its memory at the schedule's peak."""
    header = ["rank", "chunks", "time", "static", "activations", "memory"]
    rows = []
    for r in plan.ranks:
        time_s = sum(plan.stages[c].fwd_time_s + plan.stages[c].bwd_time_s for c in r.chunks)
        rows.append([str(r.index), ", ".join(map(str, r.chunks)), human_time(time_s),
                     human_bytes(r.static), human_bytes(r.activations), human_bytes(r.total)])
    return _table(header, rows, [True, False, True, True, True, True])


def format_tensor_parallel(tp_plan: TensorParallelPlan, full: dict[str, Any]) -> str:
    """What the tensor-parallel rewrite did, for the table above it (one rank's costs):
    the coverage report (the share of parameter elements sharded; every replicated linear
    or embedding and every lone linear with the reason), then every sharded parameter with
    its split and bytes per rank."""
    lines = [coverage(tp_plan).text(lone=True),
             f"tensor parallel: degree {tp_plan.size}, {len(tp_plan.sharded)} sharded "
             f"parameter(s); the table is one tp rank's (sharded work and bytes / degree, tp "
             "collectives on the link)"]
    for s in tp_plan.sharded:
        p = full.get(s.name)
        nbytes = p.numel() * p.element_size() if p is not None else 0
        local = s.local_shape  # padding rows included (a padded vocabulary)
        share = nbytes * local[s.dim] / max(s.full_shape[s.dim], 1)
        padded = f" padded by {s.pad}" if s.pad else ""
        lines.append(f"  sharded     {s.name}: {tuple(s.full_shape)} split on dim {s.dim} "
                     f"into {s.parts}{padded} -> {tuple(local)} per rank "
                     f"({human_bytes(share)} of {human_bytes(nbytes)})")
    if tp_plan.pairs:
        lines.append("  pairs (column -> row): " + ", ".join(f"{a} -> {b}"
                                                            for a, b in tp_plan.pairs))
    if tp_plan.sequence_parallel:
        lines.append("  sequence-parallel (optimize: memory): activations between the pairs "
                     "held by sequence chunk; gradients summed over tp for "
                     + ", ".join(tp_plan.sequence_parallel))
    return "\n".join(lines)


def format_table(plan: PartitionPlan) -> str:
    """The per-stage table the CLI prints; ``*`` marks the bottleneck stage. With several
    chunks per rank a stage is a chunk: a ``rank`` column, then ``format_ranks``."""
    chunked = bool(plan.placement)
    header = ["stage", *(["rank"] if chunked else []), "modules", "params", "param mem",
              "FLOPs", "time", "comm", "memory", "in flight", "recv", "send", "cost"]
    rows = []
    for st in plan.stages:
        mark = "*" if st.index == plan.bottleneck_stage else " "
        rows.append([f"{mark}{st.index}",
                     *([str(plan.rank_of[st.index])] if chunked else []),
                     _modules_cell(st.modules), str(len(st.params)),
                     human_bytes(st.param_bytes), human_count(st.flops, "F"),
                     human_time(st.time_s), human_time(st.comm_time_s),
                     human_bytes(st.memory.total), str(st.memory.in_flight),
                     human_bytes(plan.stages[st.index - 1].out_bytes if st.index else 0),
                     human_bytes(st.out_bytes),
                     f"{st.cost:.4f}"])
    right = [True, *([True] if chunked else []), False] + [True] * 10
    kind = "chunks" if chunked else "stages"
    lines = [f"plan: {len(plan.stages)} {kind} on {plan.device.get('name')}"
             + (f" ({shape_words(plan)}, placement {list(plan.rank_of)})" if chunked else "")
             + f", memory_weight {plan.config.memory_weight}, strategy {plan.strategy}"]
    lines += _table(header, rows, right)
    if plan.ranks:
        lines.append("")
        lines += format_ranks(plan)
    for sp in plan.shared_params:
        lines.append(f"shared: {', '.join(sp.names)} ({human_bytes(sp.nbytes)}) on stages "
                     f"{', '.join(map(str, sp.stages))}: {sp.handling}")
    empty = [str(st.index) for st in plan.stages if st.flops == 0 and not st.params]
    if empty:
        lines.append(f"note: stage(s) {', '.join(empty)} hold no parameters and no FLOPs "
                     "(too many partitions for this model, or boundary latency dominates)")
    lines.append(f"* bottleneck stage {plan.bottleneck_stage}")
    lines.append(summary_line(plan))
    return "\n".join(lines)


def format_memory(plan: PartitionPlan) -> str:
    """Each stage's memory: static state, activations per microbatch x in flight, the
    recompute transient and offloaded bytes of checkpointing, and what recomputation adds
    to the backward."""
    header = ["stage", "params+grads", "optimizer", "act/mb", "in flight", "activations",
              "transient", "offloaded/mb", "recompute", "total", "checkpointed"]
    rows = []
    for st in plan.stages:
        m = st.memory
        rows.append([str(st.index), human_bytes(m.params + m.grads + m.buffers),
                     human_bytes(m.optimizer_state), human_bytes(m.activations_per_microbatch),
                     str(m.in_flight), human_bytes(m.activations),
                     human_bytes(m.recompute_transient), human_bytes(m.offloaded_per_microbatch),
                     human_time(st.recompute_time_s), human_bytes(m.total),
                     _modules_cell(summarise_modules(st.checkpointed)) or "-"])
    return "\n".join(["memory per stage (activations per microbatch x microbatches in flight; "
                      "a checkpointed region keeps its inputs)"]
                     + _table(header, rows, [True] * 10 + [False]))


@dataclass(frozen=True)
class CompareRow:
    """One strategy's partition under the plan's objective (for ``--compare``)."""

    name: str
    stage_costs: tuple[float, ...]
    bottleneck: float
    lower_bound: float
    step_time_s: float | None = None


def format_compare(rows: Sequence[CompareRow]) -> str:
    """Strategies side by side: bottleneck, bottleneck / lower bound, per-stage costs."""
    best = min(r.bottleneck for r in rows)
    header = ["strategy", "bottleneck", "/ lower bound", "/ best", "step", "stage costs"]
    body = [[r.name, f"{r.bottleneck:.4f}",
             f"{r.bottleneck / r.lower_bound:.3f}" if r.lower_bound > 0 else "-",
             f"{r.bottleneck / best:.3f}" if best > 0 else "-",
             human_time(r.step_time_s) if r.step_time_s is not None else "-",
             " ".join(f"{c:.3f}" for c in r.stage_costs)] for r in rows]
    return "\n".join(_table(header, body, [False, True, True, True, True, False]))


def _dot_id(name: str) -> str:
    """A quoted dot string; newlines become dot's ``\\n`` line breaks."""
    text = name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def to_dot(gm: torch.fx.GraphModule, plan: PartitionPlan) -> str:
    """Graphviz dot text: one cluster per stage, boundary edges labelled with their bytes."""
    stage_of = {name: st.index for st in plan.stages for name in st.nodes}
    by_name = {n.name: n for n in gm.graph.nodes}
    nbytes = {b.value: b.nbytes for st in plan.stages for b in st.sent}
    lines = ["digraph plan {", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", '
             'fontname="Helvetica", fontsize=10];', "  edge [fontsize=9];"]
    for st in plan.stages:
        colour = STAGE_COLOURS[st.index % len(STAGE_COLOURS)]
        lines.append(f"  subgraph cluster_stage{st.index} {{")
        lines.append(f'    label="stage {st.index}: {human_time(st.time_s)}, '
                     f'{human_bytes(st.memory.total)}"; style=dashed;')
        for name in st.nodes:
            node = by_name.get(name)
            path = meta.MODULE_PATH.get(node, "") if node is not None else ""
            label = f"{name}\n{path}" if path else name
            lines.append(f'    {_dot_id(name)} [label={_dot_id(label)}, fillcolor="{colour}"];')
        lines.append("  }")
    for node in gm.graph.nodes:
        for user in node.users:
            a, b = stage_of.get(node.name), stage_of.get(user.name)
            attrs = ""
            if a is not None and b is not None and a != b:
                size = nbytes.get(node.name)
                if size is None:  # tuple outputs are listed per element
                    size = sum(v for k, v in nbytes.items() if k.startswith(node.name + "["))
                attrs = f' [label="{human_bytes(size)}", color=red, penwidth=2]'
            lines.append(f"  {_dot_id(node.name)} -> {_dot_id(user.name)}{attrs};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def draw_timeline(sim: SimResult, path: str, title: str = "") -> None:
    """PNG of a simulated step: one row per rank; forward, backward, input and weight
    gradients coloured; each box labelled with its microbatch (and chunk, when a rank
    holds several)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    ranks = 1 + max((e.rank for e in sim.timeline), default=0)
    several = len({e.action.stage for e in sim.timeline}) > ranks
    fig, ax = plt.subplots(figsize=(12, 0.6 * ranks + 1.6))
    scale, unit = (1e3, "ms") if sim.step_time_s < 1 else (1.0, "s")
    colours = {FORWARD: "#56B4E9", "B": "#E69F00", "I": "#D55E00", "W": "#009E73"}
    for e in sim.timeline:
        start, width = e.start_s * scale, (e.end_s - e.start_s) * scale
        ax.broken_barh([(start, width)], (e.rank - 0.4, 0.8),
                       facecolors=colours[e.action.kind], edgecolors="black", linewidth=0.5,
                       alpha=0.65 if several and e.action.stage >= ranks else 1.0)
        if width > 0:
            label = (f"{e.action.microbatch}" if not several
                     else f"{e.action.microbatch}\n c{e.action.stage}")
            ax.text(start + width / 2, e.rank, label, ha="center", va="center",
                    fontsize=6 if several else 8, clip_on=True)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, sim.step_time_s * scale * 1.01 or 1.0)
    ax.set_title(title or f"step {human_time(sim.step_time_s)}, bubble "
                 f"{sim.bubble_fraction:.1%}", loc="left")
    kinds = sorted({e.action.kind for e in sim.timeline}, key="FBIW".index)
    names = {FORWARD: "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
    ax.legend(handles=[Patch(color=colours[k], label=names[k]) for k in kinds],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(kinds), fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
