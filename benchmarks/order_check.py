"""What ``SMP_FX_CHECK_ORDER=1`` costs: a recorded call, and a step's check, in one process.

A call through a wrapped ``ProcessGroup`` method against torch's own (an all-reduce of 4
floats on a one-rank gloo world, the best of ``--repeat`` rounds of ``--calls`` calls), and
the check at a step's end holding ``--calls`` calls (the gather of one rank's record and
the comparison; across ranks the gather grows with their number).

    python benchmarks/order_check.py
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import smp_fx as smp  # noqa: E402
from smp_fx.world import order_mode, state  # noqa: E402


def _per_call_us(calls: int) -> float:
    t = torch.ones(4)
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    smp.init({"pipeline_parallel_degree": 1})
    off = min(_per_call_us(args.calls) for _ in range(args.repeat))
    order_mode.install(timedelta(seconds=60), state.get().groups, state.get().object_groups)
    on = min(_per_call_us(args.calls) for _ in range(args.repeat - 1))
    _per_call_us(args.calls)
    start = time.perf_counter()
    with order_mode.checked_step():
        pass
    check_ms = (time.perf_counter() - start) * 1e3
    state._reset()
    print(f"all_reduce of 4 floats: {off:.1f} us off, {on:.1f} us recorded "
          f"(+{on - off:.1f} us); a step's check of {args.calls} calls: {check_ms:.0f} ms")


if __name__ == "__main__":
    main()
