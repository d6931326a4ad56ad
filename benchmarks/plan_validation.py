"""The planner against public training runs it was not fitted on: predicted / published.

Each row of ``benchmarks/data/public_runs.csv`` is one published run (its source in the
row): hardware (a built-in cluster), a GPT shape (``examples/models/gpt.py`` on the meta
device), tp / pp / dp, batch, sequence and what else the source says. The planner prices
the published configuration (``--fix`` of every published key; keys the source leaves
out, blank in the file, are the planner's pick), the predicted step becomes TFLOP/s per
GPU by the source's own FLOP count, and the table prints predicted / published with the
median and worst |ratio - 1| per GPU type. Rows marked ``fitted`` are those a constant of
smp-fx was fitted on: printed, listed, and left out of the statistics.

    .venv/bin/python benchmarks/plan_validation.py [--rows ID,ID] [--gpu H100]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from models.gpt import build_model, example_inputs  # noqa: E402

from cost_model.cluster import get_cluster  # noqa: E402
from cost_model.errors import SMPError  # noqa: E402
from cost_model.gpu_specs import FITTED_ON  # noqa: E402
from smp_fx.planner.model import Prepared, prepare  # noqa: E402
from smp_fx.planner.planner import plan  # noqa: E402
from smp_fx.planner.step import Setting  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "public_runs.csv"
FLOAT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run, as the data file states it (blank: not published)."""

    id: str
    gpu: str
    cluster: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    gpus: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    mbs: int | None
    vp: int | None
    recompute: str | None
    sp: bool | None
    zero: str
    precision: str
    runtime: str
    flops: str
    metric: str
    published: float
    fitted: bool
    source: str

    def step_flops(self) -> float:
        """FLOPs per step as the source counts them (the file's header)."""
        b, s, n, h, v = self.global_batch, self.seq, self.layers, self.hidden, self.vocab
        if self.flops == "megatron":
            return 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))
        if self.flops == "eq3":
            return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
        raise ValueError(f"row {self.id}: unknown flops count {self.flops!r} "
                         "(use 'megatron' or 'eq3', the file's header)")

    @property
    def tflops_per_gpu(self) -> float:
        """The published figure as TFLOP/s per GPU by the source's FLOP count."""
        if self.metric == "tflops_per_gpu":
            return self.published
        if self.metric == "step_s":
            return self.step_flops() / self.gpus / self.published / 1e12
        raise ValueError(f"row {self.id}: unknown metric {self.metric!r} "
                         "(use 'tflops_per_gpu' or 'step_s')")

    def fix(self) -> dict[str, object]:
        """The published keys; Megatron's 1F1B (interleaved when v > 1) schedule."""
        out: dict[str, object] = {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                                  "zero": self.zero, "schedule": "interleaved"}
        for key, value in (("mbs", self.mbs), ("vp", self.vp),
                           ("recompute", self.recompute), ("sp", self.sp)):
            if value is not None:
                out[key] = value
        return out


def read_runs(path: Path = DATA) -> list[Run]:
    """The data file's rows; a row missing a required column is an error naming it."""
    lines = [x for x in path.read_text().splitlines() if x and not x.startswith("#")]
    out = []
    for r in csv.DictReader(lines):
        def opt(key: str, row: dict[str, str] = r) -> int | None:
            return int(row[key]) if row[key].strip() else None
        out.append(Run(
            r["id"], r["gpu"], r["cluster"], int(r["layers"]), int(r["hidden"]),
            int(r["heads"]), int(r["vocab"]), int(r["seq"]), int(r["gpus"]), int(r["tp"]),
            int(r["pp"]), int(r["dp"]), int(r["global_batch"]), opt("mbs"), opt("vp"),
            r["recompute"].strip() or None, {"true": True, "false": False}.get(r["sp"]),
            r["zero"], r["precision"], r["runtime"], r["flops"], r["metric"],
            float(r["published"]), r["fitted"] == "yes", r["source"]))
    return out


def prepared_for(run: Run) -> Prepared:
    with torch.device("meta"):
        model = build_model(n_layer=run.layers, n_embd=run.hidden, n_head=run.heads,
                            vocab_size=run.vocab, seq_len=run.seq).to(FLOAT[run.precision])
    inputs = functools.partial(example_inputs, seq_len=run.seq, vocab_size=run.vocab)
    return prepare(model, inputs, run.id)


def price(run: Run, prep: Prepared | None = None) -> tuple[float, str]:
    """(predicted TFLOP/s per GPU by the source's count, the plan priced)."""
    setting = Setting(get_cluster(run.cluster), run.gpus, run.global_batch, run.precision,
                      runtime=run.runtime)
    best = plan(prep or prepared_for(run), setting, fixed=run.fix(), top_k=1).best
    return run.step_flops() / run.gpus / best.step_time_s / 1e12, best.candidate.label()


def summary(ratios: dict[str, list[float]]) -> list[str]:
    """Median and worst |ratio - 1| per GPU type."""
    return [f"{gpu}: {len(r)} runs, median |ratio - 1| "
            f"{statistics.median(abs(x - 1) for x in r):.3f} (target 0.10), worst "
            f"{max(abs(x - 1) for x in r):.3f} (target 0.25)"
            for gpu, r in sorted(ratios.items())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", type=Path, default=DATA)
    ap.add_argument("--rows", default="", help="comma-separated row ids (default: all)")
    ap.add_argument("--gpu", default="", help="only this GPU type")
    args = ap.parse_args(argv)
    runs = [r for r in read_runs(args.csv)
            if (not args.rows or r.id in args.rows.split(","))
            and (not args.gpu or r.gpu == args.gpu)]
    t0 = time.perf_counter()
    print(f"{'run':<28} {'GPUs':>5} {'tp':>2} {'pp':>3} {'dp':>3} {'published':>9} "
          f"{'predicted':>9} {'ratio':>6}  plan priced")
    ratios: dict[str, list[float]] = {}
    for run in runs:
        try:
            pred, label = price(run)
        except SMPError as exc:
            print(f"{run.id:<28} refused: {str(exc).splitlines()[0]}")
            continue
        ratio = pred / run.tflops_per_gpu
        if not run.fitted:
            ratios.setdefault(run.gpu, []).append(ratio)
        mark = "  [fitted on]" if run.fitted else ""
        print(f"{run.id:<28} {run.gpus:>5} {run.tp:>2} {run.pp:>3} {run.dp:>3} "
              f"{run.tflops_per_gpu:>9.1f} {pred:>9.1f} {ratio:>6.3f}  {label}{mark}",
              flush=True)
    for line in summary(ratios):
        print(line)
    fitted = sorted({r.source for r in runs if r.fitted})
    fits: dict[str, list[str]] = {}
    for gpu, (field, how) in sorted(FITTED_ON.items()):
        fits.setdefault(f"{field}: {how}", []).append(gpu)
    for what, gpus in fits.items():
        print(f"fitted ({', '.join(gpus)}) {what}")
    for src in fitted:
        print(f"  rows fitted on (not counted above): {src}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
