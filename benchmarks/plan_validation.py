"""The planner against public training runs it was not fitted on: predicted / published.

Each row of ``benchmarks/data/public_runs.csv`` is one published run (its source in the
row): hardware (a built-in cluster), the model (a GPT shape built by
``examples/models/gpt.py``, or a ``config.json`` under ``examples/configs/`` built as
``smp-fx plan --hf-config`` builds it), both on the meta device, tp / pp / cp / dp, batch,
sequence and what else the source says. The planner prices the published configuration
(``--fix`` of every published key; keys the source leaves out, blank in the file, are the
planner's pick), the predicted step becomes TFLOP/s per GPU by the source's own FLOP
count, and the table prints predicted / published with the median and worst |ratio - 1|
per GPU type. A row the planner refuses is printed with the reason and counted. Rows
marked ``fitted`` are those a constant of smp-fx was fitted on: printed, listed, and left
out of the statistics.

    .venv/bin/python benchmarks/plan_validation.py [--rows ID,ID] [--gpu H100]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from models.gpt import build_model, example_inputs  # noqa: E402

from cost_model.cluster import ClusterSpec, get_cluster  # noqa: E402
from cost_model.errors import SMPError  # noqa: E402
from cost_model.gpu_specs import FITTED_ON, with_attention  # noqa: E402
from smp_fx.planner.hf_config import prepare_config  # noqa: E402
from smp_fx.planner.model import Prepared, prepare  # noqa: E402
from smp_fx.planner.overlap import RUNTIMES  # noqa: E402
from smp_fx.planner.planner import plan  # noqa: E402
from smp_fx.planner.step import Setting  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "public_runs.csv"
CONFIGS = ROOT / "examples" / "configs"
FLOAT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def config_shape(name: str) -> dict[str, int]:
    """A config's shape under the FLOP counts' names (its ``config.json`` keys)."""
    doc = json.loads((CONFIGS / name).read_text())
    heads = int(doc["num_attention_heads"])
    return {"layers": int(doc["num_hidden_layers"]), "hidden": int(doc["hidden_size"]),
            "heads": heads, "groups": int(doc.get("num_key_value_heads") or heads),
            "ffn": int(doc["intermediate_size"]), "vocab": int(doc["vocab_size"])}


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run, as the data file states it (blank: not published)."""

    id: str
    gpu: str
    cluster: str
    config: str | None
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    gpus: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    global_batch: int
    mbs: int | None
    vp: int | None
    recompute: str | None
    sp: bool | None
    zero: str | None
    precision: str
    runtime: str
    flops: str
    metric: str
    published: float
    tokens_per_gpu_s: float | None
    fitted: bool
    source: str
    attention: str | None = None
    """Transformer Engine's attention backend where the recipe picks one
    (``cost_model.gpu_specs.ATTENTION_BACKENDS``); blank: the GPU's default."""
    grads: str = "fp32"
    """Megatron-Core's gradient buffer and reduction dtype (``Setting.megatron_grads``);
    blank: fp32, its default."""
    fp8_params: bool = False
    """An FP8 recipe keeps the layers' weights in FP8 alone (``Setting.fp8_params``)."""
    split_ends: bool = False
    """Megatron-Core's layer split counts the embedding and the loss as layers
    (``Setting.split_ends``)."""

    @property
    def values(self) -> str:
        """The precision the run's values are in (an FP8 run's: bf16, its GEMMs in FP8)."""
        return "bf16" if self.precision == "fp8" else self.precision

    def step_flops(self) -> float:
        """FLOPs per step as the source counts them (the file's header)."""
        b, s, n, h, v = self.global_batch, self.seq, self.layers, self.hidden, self.vocab
        if self.flops == "megatron":
            return 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))
        if self.flops == "eq3":
            return 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
        if self.flops == "nemo-llama" and self.config:
            g = config_shape(self.config)
            return b * s * (12 * n * h * h * (1 + g["groups"] / g["heads"] + s / h)
                            + 18 * n * g["ffn"] * h + 6 * v * h)
        if self.flops == "implied" and self.metric == "tflops_per_gpu" \
                and self.tokens_per_gpu_s:
            return self.published * 1e12 * b * s / self.tokens_per_gpu_s
        raise ValueError(f"row {self.id}: unknown flops count {self.flops!r} "
                         "(use 'megatron', 'eq3', 'nemo-llama' for a config row, or "
                         "'implied' with tokens_per_gpu_s: the file's header)")

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
        out: dict[str, object] = {"tp": self.tp, "pp": self.pp, "cp": self.cp,
                                  "ep": self.ep, "dp": self.dp, "schedule": "interleaved"}
        for key, value in (("mbs", self.mbs), ("vp", self.vp), ("zero", self.zero),
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
        if r["runtime"] not in RUNTIMES:
            raise ValueError(f"row {r['id']}: runtime {r['runtime']!r} is none of {RUNTIMES} "
                             "(the file's header says what each prices)")
        config = r["config"].strip() or None
        shape = config_shape(config) if config else {
            k: int(r[k]) for k in ("layers", "hidden", "heads", "vocab")}
        out.append(Run(
            r["id"], r["gpu"], r["cluster"], config, shape["layers"], shape["hidden"],
            shape["heads"], shape["vocab"],
            int(r["seq"]), int(r["gpus"]), int(r["tp"]), int(r["pp"]), opt("cp") or 1,
            opt("ep") or 1, int(r["dp"]), int(r["global_batch"]), opt("mbs"), opt("vp"),
            r["recompute"].strip() or None, {"true": True, "false": False}.get(r["sp"]),
            r["zero"].strip() or None, r["precision"], r["runtime"], r["flops"],
            r["metric"], float(r["published"]),
            float(r["tokens_per_gpu_s"]) if r["tokens_per_gpu_s"].strip() else None,
            r["fitted"] == "yes", r["source"], (r.get("attention") or "").strip() or None,
            (r.get("grads") or "").strip() or "fp32",
            (r.get("fp8_params") or "").strip() == "true",
            (r.get("split_ends") or "").strip() == "true"))
    return out


@functools.lru_cache(maxsize=4)
def _prepared(config: str | None, layers: int, hidden: int, heads: int, vocab: int,
              seq: int, precision: str, name: str) -> Prepared:
    if config:
        return prepare_config(CONFIGS / config, seq, precision)
    with torch.device("meta"):
        model = build_model(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                            seq_len=seq).to(FLOAT[precision])
    inputs = functools.partial(example_inputs, seq_len=seq, vocab_size=vocab)
    return prepare(model, inputs, name)


def prepared_for(run: Run) -> Prepared:
    """The run's model on meta: its config as ``--hf-config`` builds it, or a GPT shape
    (rows of one model, sequence and values' precision share it)."""
    return _prepared(run.config, run.layers, run.hidden, run.heads, run.vocab, run.seq,
                     run.values, run.config or f"gpt {run.layers}x{run.hidden}")


def cluster_for(run: Run) -> ClusterSpec:
    """The run's cluster, its GPU with the attention backend the run's recipe picks."""
    cluster = get_cluster(run.cluster)
    if run.attention is None:
        return cluster
    return dataclasses.replace(cluster, device=with_attention(cluster.device, run.attention))


def setting_for(run: Run) -> Setting:
    """What the planner holds fixed for the run: its cluster, size, batch and runtime."""
    return Setting(cluster_for(run), run.gpus, run.global_batch, run.values,
                   runtime=run.runtime, megatron_grads=run.grads, fp8=run.precision == "fp8",
                   fp8_params=run.fp8_params, split_ends=run.split_ends)


def price(run: Run, prep: Prepared | None = None) -> tuple[float, str]:
    """(predicted TFLOP/s per GPU by the source's count, the plan priced)."""
    best = plan(prep or prepared_for(run), setting_for(run), fixed=run.fix(), top_k=1).best
    return run.step_flops() / run.gpus / best.step_time_s / 1e12, best.candidate.label()


def summary(ratios: dict[str, list[float]], refused: dict[str, int]) -> list[str]:
    """Median and worst |ratio - 1| per GPU type, and how many of its runs were refused."""
    out = []
    for gpu in sorted(set(ratios) | set(refused)):
        r = ratios.get(gpu, [])
        figures = (f"median |ratio - 1| {statistics.median(abs(x - 1) for x in r):.3f} "
                   f"(target 0.10), worst {max(abs(x - 1) for x in r):.3f} (target 0.25)"
                   if r else "none priced")
        out.append(f"{gpu}: {len(r)} runs priced, {refused.get(gpu, 0)} refused; {figures}")
    return out


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
    print(f"{'run':<28} {'GPUs':>5} {'tp':>2} {'pp':>3} {'cp':>2} {'dp':>3} "
          f"{'published':>9} {'predicted':>9} {'ratio':>6}  plan priced")
    ratios: dict[str, list[float]] = {}
    refused: dict[str, int] = {}
    for run in runs:
        try:
            pred, label = price(run)
        except SMPError as exc:
            if not run.fitted:
                refused[run.gpu] = refused.get(run.gpu, 0) + 1
            print(f"{run.id:<28} refused: {' '.join(str(exc).split())}", flush=True)
            continue
        ratio = pred / run.tflops_per_gpu
        if not run.fitted:
            ratios.setdefault(run.gpu, []).append(ratio)
        mark = "  [fitted on]" if run.fitted else ""
        print(f"{run.id:<28} {run.gpus:>5} {run.tp:>2} {run.pp:>3} {run.cp:>2} {run.dp:>3} "
              f"{run.tflops_per_gpu:>9.1f} {pred:>9.1f} {ratio:>6.3f}  {label}{mark}",
              flush=True)
    for line in summary(ratios, refused):
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
