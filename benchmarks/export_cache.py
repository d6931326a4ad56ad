"""A restarted process loading its graphs from the export cache against exporting them.

For each architecture of ``examples/models/hf_zoo.py``: this process captures the model
(``passes.trace.trace`` through the export front end, the in-process memo off) with
``SMP_FX_EXPORT_CACHE`` pointing at a new directory, which stores the graph; then one new
Python process, as a restarted job would be, builds each model again with other weights
and captures it from the same directory. Printed per architecture: the export's and the
new process's capture CPU seconds (the calling thread's), their ratio, whether the new
process loaded the graph (a fallback when it exported: the reason is printed) and whether
the loaded graph computes its own model's output exactly.

    python benchmarks/export_cache.py [--archs llama t5 swin ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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


def capture(arch: str, seed: int) -> dict[str, Any]:
    """Capture ``arch`` built with ``seed``; CPU s, what the cache did, exactness."""
    before = (export_cache.STATS.loaded, dict(export_cache.STATS.missed))
    model, x = hf_zoo.build(arch, marked=False, seed=seed), hf_zoo.inputs(arch, 4)
    start = time.thread_time()
    gm = trace(model, x, frontend="export")
    cpu = time.thread_time() - start
    missed = {k: v - before[1].get(k, 0) for k, v in export_cache.STATS.missed.items()
              if v != before[1].get(k, 0)}
    with torch.no_grad():
        exact = bool(torch.equal(gm(*x), model(*x)))
    return {"arch": arch, "cpu": cpu, "loaded": export_cache.STATS.loaded > before[0],
            "missed": missed, "exact": exact}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=sorted(hf_zoo.ARCHITECTURES))
    ap.add_argument("--load", help=argparse.SUPPRESS)  # the new process: print JSON rows
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.load:
        with mock.patch.dict(os.environ, {export_cache.ENV: args.load, trace_memo.ENV: "0"}):
            for arch in args.archs:
                print(json.dumps(capture(arch, seed=1)), flush=True)
        return []
    with tempfile.TemporaryDirectory(prefix="smp_fx_export_cache_") as where:
        with mock.patch.dict(os.environ, {export_cache.ENV: where, trace_memo.ENV: "0"}):
            first = [capture(arch, seed=0) for arch in args.archs]
        out = subprocess.run([sys.executable, __file__, "--load", where, "--archs",
                              *args.archs], capture_output=True, text=True, check=True)
    again = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return _table(first, again)


def _table(first: list[dict[str, Any]], again: list[dict[str, Any]]) -> list[dict[str, Any]]:
    print(f"{'arch':12s} {'export s':>9s} {'restart s':>9s} {'ratio':>6s}  loaded  exact")
    rows = []
    for a, b in zip(first, again, strict=True):
        row = {"arch": a["arch"], "export": a["cpu"], "restart": b["cpu"],
               "loaded": b["loaded"], "exact": b["exact"], "missed": b["missed"]}
        rows.append(row)
        why = "" if row["loaded"] else f"  fallback: {row['missed']}"
        print(f"{row['arch']:12s} {row['export']:9.3f} {row['restart']:9.3f} "
              f"{row['restart'] / row['export']:6.3f}  {str(row['loaded']):6s}  "
              f"{row['exact']}{why}", flush=True)
    loaded = sum(r["loaded"] for r in rows)
    ratios = sorted(r["restart"] / r["export"] for r in rows)
    print(f"loaded in the new process: {loaded} of {len(rows)} architectures (fallbacks "
          f"{len(rows) - loaded}); restart / export {ratios[0]:.3f}-{ratios[-1]:.3f}, "
          f"median {statistics.median(ratios):.3f}")
    return rows


if __name__ == "__main__":
    main()
