"""A graph handed between processes against each exporting it: what one export per host saves.

For each architecture of ``examples/models/hf_zoo.py``, in one process (the memo off, so
every export is a real one): the export of a model (``passes.trace.trace`` through the
export front end), ``passes.trace_share.to_bytes`` of its graph (what the exporting rank
adds), ``from_bytes`` into a second model of other weights (what each other rank pays
instead of its export), the bytes, and whether the rebuilt graph computes the second
model's output exactly. CPU seconds of the calling thread after a garbage collection,
median of ``--rounds``. An architecture whose graph cannot be handed on is printed with the
reason: a fallback (each rank exports it).

    python benchmarks/trace_share.py [--archs llama t5 swin ...] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cost_model.errors import one_line  # noqa: E402
from examples.models import hf_zoo  # noqa: E402
from passes import export_cache, trace_memo, trace_share  # noqa: E402
from passes.trace import trace  # noqa: E402


def _cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    start = time.thread_time()
    out = fn()
    return time.thread_time() - start, out


def measure(arch: str, rounds: int) -> dict[str, Any]:
    """Export, to_bytes and from_bytes of ``arch`` (CPU s, medians), the bytes, exactness."""
    times: dict[str, list[float]] = {"export": [], "to_bytes": [], "from_bytes": []}
    row: dict[str, Any] = {"arch": arch, "fallback": None}
    for _ in range(rounds):
        a, b = hf_zoo.build(arch, marked=False, seed=0), hf_zoo.build(arch, marked=False, seed=1)
        x = hf_zoo.inputs(arch, 4)
        t, gm = _cpu(lambda m=a, i=x: trace(m, i, frontend="export"))
        times["export"].append(t)
        try:
            t, data = _cpu(lambda g=gm, m=a: trace_share.to_bytes(g, m))
            times["to_bytes"].append(t)
            t, rebuilt = _cpu(lambda d=data, m=b: trace_share.from_bytes(d, m))
            times["from_bytes"].append(t)
        except Exception as exc:
            row["fallback"] = one_line(exc)
            break
        with torch.no_grad():
            row["exact"] = bool(torch.equal(rebuilt(*x), b(*x)))
        row["bytes"] = len(data)
    row.update({k: statistics.median(v) for k, v in times.items() if v})
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", default=sorted(hf_zoo.ARCHITECTURES))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    why_not = trace_share.available()
    if why_not is not None:
        print(f"graphs cannot be handed on here: {why_not}")
        return []
    torch.set_num_threads(1)
    with mock.patch.dict(os.environ, {trace_memo.ENV: "0", export_cache.ENV: ""}):
        return _table(args.archs, args.rounds)  # every export a real one


def _table(archs: list[str], rounds: int) -> list[dict[str, Any]]:
    rows = []
    print(f"{'arch':12s} {'export s':>9s} {'to_bytes':>9s} {'from_bytes':>10s} "
          f"{'load/export':>11s} {'MB':>5s}  exact")
    for arch in archs:
        r = measure(arch, rounds)
        rows.append(r)
        if r["fallback"]:
            print(f"{arch:12s} {r['export']:9.3f}  not handed on: {r['fallback']}", flush=True)
            continue
        print(f"{arch:12s} {r['export']:9.3f} {r['to_bytes']:9.3f} {r['from_bytes']:10.3f} "
              f"{r['from_bytes'] / r['export']:11.3f} {r['bytes'] / 1e6:5.2f}  {r['exact']}",
              flush=True)
    handed = [r for r in rows if not r["fallback"]]
    if handed:
        ratios = sorted(r["from_bytes"] / r["export"] for r in handed)
        print(f"handed on: {len(handed)} of {len(rows)} architectures (fallbacks "
              f"{len(rows) - len(handed)}); load / export median {statistics.median(ratios):.3f}, "
              f"worst {ratios[-1]:.3f}; exact on {sum(r['exact'] for r in handed)}")
    return rows


if __name__ == "__main__":
    main()
