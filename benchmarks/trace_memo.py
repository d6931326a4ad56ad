"""A model exported again in one process: the first export against the reuse.

For each architecture of ``examples/models/hf_zoo.py``: two models of it (other seeds) are
captured by ``passes.trace.trace`` in turn, each timed by the calling thread's CPU clock
after a garbage collection, so neither another thread's work (one a caller left running)
nor collecting a caller's garbage counts (the median of ``--rounds``, the memo cleared
before each round). Printed per architecture:
the first capture, the second, their ratio, whether the second reused the first's program,
and the models the memo gave no key (exported as before) with the reason: the fallbacks.

    python benchmarks/trace_memo.py [--archs llama gpt2 ...] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.models import hf_zoo  # noqa: E402
from passes import export_cache, trace_memo  # noqa: E402
from passes.trace import trace  # noqa: E402


def _capture_cpu(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> float:
    gc.collect()
    start = time.thread_time()
    trace(model, inputs)
    return time.thread_time() - start


def measure(arch: str, rounds: int) -> dict[str, Any]:
    """The first and second capture of ``arch`` (CPU s, medians), and what the memo did."""
    first: list[float] = []
    second: list[float] = []
    reused = True
    for _ in range(rounds):
        trace_memo.clear()
        a, b = hf_zoo.build(arch, seed=0), hf_zoo.build(arch, seed=1)
        x = hf_zoo.inputs(arch, 4)
        first.append(_capture_cpu(a, x))
        second.append(_capture_cpu(b, x))
        reused = reused and trace_memo.STATS.hits == 1
    unkeyed = dict(trace_memo.STATS.unkeyed)
    return {"arch": arch, "first_s": statistics.median(first),
            "second_s": statistics.median(second), "reused": reused, "unkeyed": unkeyed}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=sorted(hf_zoo.ARCHITECTURES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with mock.patch.dict(os.environ, {export_cache.ENV: ""}):  # every first capture exports
        rows = _table(args.archs, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def _table(archs: list[str], rounds: int) -> list[dict[str, Any]]:
    rows = []
    print(f"{'arch':12s} {'first s':>8s} {'again s':>8s} {'ratio':>6s}  reused  no key")
    for arch in archs:
        r = measure(arch, rounds)
        rows.append(r)
        reasons = "; ".join(f"{why} (x{n})" for why, n in r["unkeyed"].items()) or "-"
        print(f"{arch:12s} {r['first_s']:8.3f} {r['second_s']:8.3f} "
              f"{r['second_s'] / r['first_s']:6.3f}  {str(r['reused']):6s}  {reasons}",
              flush=True)
    fallbacks = sum(1 for r in rows if r["unkeyed"])
    print(f"reused on {sum(r['reused'] for r in rows)} of {len(rows)} architectures; "
          f"exported without a key (fallback) on {fallbacks}")
    return rows


if __name__ == "__main__":
    main()
