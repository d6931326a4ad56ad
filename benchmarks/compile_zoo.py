"""Every Hugging Face architecture of ``examples/models/hf_zoo.py`` compiled (``compile``) at
pp 2, both stages in this process, against the plain model trained in one process: which
match, which stages run eagerly and why, how many gradients were copied out of another's
memory (``compiled.unalias_gradients``).

Per architecture and schedule (1F1B: ``interleaved`` v = 1; ZB-V: ``zbv`` v = 2, its
chunks that receive gradients compiled with their GEMMs' weight gradients deferred to W):
two SGD steps (learning rate 1, so the parameters after them carry the gradients) on a
batch of two split into two microbatches of one sample each (where a size-1 batch
dimension lets the compiler hand one gradient as a view of another's), one intra-op thread.
A row reads ``ok`` when every parameter is within 1e-5 of the one-process run's, else the
number that are not and the worst absolute difference; then the stages compiled whole or
in parts, the stages and regions running eagerly (a fallback, or a split backward's
checkpointed region; each reason below the table), recompiles, copied
gradients and the seconds the row took (its compiles included). Architectures the
installed transformers lacks are listed as absent. Exits 1 if any row mismatches.

``--checkpointed`` checkpoints every layer; ``--lengths`` steps at each sequence length in
turn (at least ``STEPS`` steps), so each new length is a new input shape for the compiled
stages (image models keep their image).

    python benchmarks/compile_zoo.py [--backend aot_eager|inductor] [--archs llama,vit]
        [--checkpointed] [--lengths 16,24,12]
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEDULES = (("1F1B", "interleaved", 1), ("ZB-V", "zbv", 2))
BATCH, MICROBATCHES, STEPS, LR, TOL = 2, 2, 2, 1.0, 1e-5


@dataclass
class Row:
    """One architecture under one schedule."""

    arch: str
    schedule: str
    mismatched: int = 0
    worst: float = 0.0
    compiled: int = 0
    eager: list[str] = field(default_factory=list)
    recompiles: int = 0
    copied: int = 0
    seconds: float = 0.0
    error: str | None = None

    def line(self) -> str:
        if self.error is not None:
            return f"{self.arch:<12} {self.schedule:<5} error: {self.error}"
        match = "ok" if not self.mismatched else f"{self.mismatched} off (max {self.worst:.2g})"
        return (f"{self.arch:<12} {self.schedule:<5} {match:<22} {self.compiled:>8} "
                f"{len(self.eager):>6} {self.recompiles:>10} {self.copied:>7} "
                f"{self.seconds:>6.1f}")


HEADER = (f"{'arch':<12} {'sched':<5} {'vs one process':<22} {'compiled':>8} {'eager':>6} "
          f"{'recompiles':>10} {'copied':>7} {'s':>6}")


def run_row(arch: str, schedule: str, pipeline: str, v: int, backend: str,
            checkpointed: bool = False, lengths: tuple[int, ...] = ()) -> Row:
    """``arch`` compiled under ``pipeline`` against ``tests.helpers.zoo``'s one-process run;
    ``checkpointed``: every layer activation-checkpointed; ``lengths``: each step's sequence
    length in turn (``STEPS`` of them), so the compiled stages see new shapes."""
    from examples.models import hf_zoo
    from tests.helpers import zoo

    row, start = Row(arch, schedule), time.perf_counter()
    lengths = lengths or (hf_zoo.SEQ,)
    steps = max(STEPS, len(lengths))
    sgd = functools.partial(torch.optim.SGD, lr=LR)
    _, want = zoo.reference(arch, BATCH, steps, sgd, lengths=lengths)
    run = zoo.DistributedRun(arch, {"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES,
                                    "active_microbatches": MICROBATCHES, "pipeline": pipeline,
                                    "virtual_pipeline_degree": v, "compile": backend},
                             sgd, checkpointed=checkpointed)
    for batch in zoo.batches(arch, BATCH, steps, lengths):
        run.step(batch)
    got = run.state()
    for name, value in want.items():
        diff = (got[name].double() - value.double()).abs()
        if not torch.all(diff <= TOL + TOL * value.double().abs()):
            row.mismatched += 1
            row.worst = max(row.worst, float(diff.max()))
    for s, st in sorted(run.model.parallelized.compiled.items()):
        if st.fallback is not None:
            row.eager.append(f"stage {s}: {st.fallback}")
        else:
            row.compiled += 1
        row.eager += [f"stage {s} region {r.region}: {r.fallback}" for r in st.regions
                      if r.fallback is not None]
        if st.checkpointed:
            row.eager.append(f"stage {s}: {st.checkpointed} checkpointed regions (rebuilt once "
                             "for I and W, recompute_once, which dynamo does not trace)")
        row.recompiles += st.recompiles
        row.copied += st.unaliased + sum(r.unaliased for r in st.regions)
    row.seconds = time.perf_counter() - start
    return row


def main(argv: list[str] | None = None) -> int:
    from examples.models import hf_zoo

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    ap.add_argument("--archs", default=",".join(hf_zoo.ARCHITECTURES),
                    help="comma-separated hf_zoo architectures (default: all)")
    ap.add_argument("--checkpointed", action="store_true",
                    help="every layer activation-checkpointed (smp.set_activation_checkpointing)")
    ap.add_argument("--lengths", default="",
                    help="comma-separated sequence lengths, one per step in turn (e.g. 16,24,"
                         "12: each new length a new input shape for the compiled stages)")
    args = ap.parse_args(argv)
    try:
        lengths = tuple(int(n) for n in args.lengths.split(",") if n)
    except ValueError:
        ap.error(f"--lengths {args.lengths!r}: give whole numbers separated by commas")
    archs = [a for a in args.archs.split(",") if a]
    unknown = sorted(set(archs) - set(hf_zoo.ARCHITECTURES))
    if unknown:
        ap.error(f"unknown architectures {unknown}; hf_zoo has {sorted(hf_zoo.ARCHITECTURES)}")
    torch.set_num_threads(1)
    quiet = logging.getLogger("smp_fx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the reasons go below the table
    try:
        return _table(archs, args.backend, args.checkpointed, lengths)
    finally:
        quiet.setLevel(level)


def _table(archs: list[str], backend: str, checkpointed: bool = False,
           lengths: tuple[int, ...] = ()) -> int:
    """Print the rows, the summary and the eager stages' reasons; 1 if a row mismatches."""
    import transformers

    from examples.models import hf_zoo

    extra = ("every layer checkpointed, " if checkpointed else "") + (
        f"sequence lengths {list(lengths)}, " if lengths else "")
    print(f"compiled ({backend}) vs one process, pp 2 in one process, {extra}transformers "
          f"{transformers.__version__}, torch {torch.__version__}", flush=True)
    print(HEADER, flush=True)
    rows: list[Row] = []
    absent = [a for a in archs if not hasattr(transformers, hf_zoo.ARCHITECTURES[a].model)]
    for arch in (a for a in archs if a not in absent):
        for schedule, pipeline, v in SCHEDULES:
            try:
                row = run_row(arch, schedule, pipeline, v, backend, checkpointed, lengths)
            except Exception as exc:  # a row that fails says so; the others still run
                row = Row(arch, schedule, error=f"{type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
            rows.append(row)
            print(row.line(), flush=True)
    bad = [r for r in rows if r.mismatched or r.error is not None]
    print(f"\n{len(rows)} rows: {len(rows) - len(bad)} equal the one-process run; "
          f"{sum(len(r.eager) for r in rows)} stages or regions eager; "
          f"{sum(r.copied for r in rows)} gradients copied; absent here: {absent or 'none'}")
    for r in rows:
        for reason in r.eager:
            print(f"  {r.arch} {r.schedule} {reason}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
