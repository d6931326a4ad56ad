"""What the straggler watch's exchange costs a rank: the object all-gather against the row.

On 2 gloo ranks, ``--exchanges`` times each (alternated rounds, 2 ms of sleep standing for
the steps between): ``smp.allgather`` of a window's figures as the watch sent them (a
dict of 7 floats, the group, the rank's name), and ``comm.row_gather``'s launch of 7
floats and, after the sleep, its read. Medians of the calling thread's CPU time and wall
time per exchange, rank 0's and rank 1's.

    python benchmarks/row_gather.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    c0, w0 = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - c0, time.perf_counter() - w0


def _worker(exchanges: int) -> dict[str, tuple[float, float]]:
    import torch

    import smp_fx as smp
    from smp_fx.runtime.executor.stragglers import PARTS, ROW
    from smp_fx.world import comm

    torch.set_num_threads(1)
    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    told = (dict.fromkeys((*PARTS, "own"), 0.01), (0, 1), f"rank {smp.rank()} (stage 0)")
    launch = comm.row_gather(comm.WORLD, len(ROW))
    row = [0.01] * len(ROW)
    got: dict[str, list[tuple[float, float]]] = {"object": [], "launch": [], "read": []}
    for _ in range(exchanges):
        got["object"].append(_timed(lambda: comm.allgather(told, comm.WORLD)))
        time.sleep(0.002)
        reads: list[Any] = []
        got["launch"].append(_timed(lambda: reads.append(launch(row))))  # noqa: B023
        time.sleep(0.002)
        got["read"].append(_timed(reads[0]))
    comm.barrier()
    return {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
            for k, v in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exchanges", type=int, default=300)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.helpers.dist import run_ranks

    for rank, res in enumerate(run_ranks(_worker, 2, args.exchanges, timeout=600)):
        print(f"rank {rank}: " + ", ".join(f"{k} {c * 1e3:.3f} ms CPU / {w * 1e3:.3f} ms wall"
                                            for k, (c, w) in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
