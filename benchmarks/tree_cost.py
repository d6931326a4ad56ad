"""What a command costs: wall seconds and CPU seconds summed over its whole process tree.

A multi-process test's ranks are forked by ``tests.helpers.dist``'s forkserver, which
reaps them but is itself orphaned when pytest exits: the kernel hands it to init, so the
``getrusage(RUSAGE_CHILDREN)`` of the process that started pytest (what ``time`` reports)
misses the forkserver and every rank it forked. This script makes itself a child subreaper
(Linux ``prctl(PR_SET_CHILD_SUBREAPER)``): orphans of its tree are handed to it, it waits
for them after the command, and their CPU lands in its own children's usage.

Each command runs ``--repeat`` times; with ``--trees`` the same command runs in each
working tree in turn (``PYTHONPATH`` and the working directory set to it), alternating
tree by tree within each repeat, so drift on a shared machine falls on every tree alike.
It prints every run and the medians.

    python benchmarks/tree_cost.py -- .venv/bin/python -m pytest -q tests/smp_fx/test_schedules.py
    python benchmarks/tree_cost.py --repeat 3 --trees /work/main /work/wt-x -- \\
        .venv/bin/python -m pytest -q -p no:cacheprovider tests/smp_fx/test_numerics.py
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36
ORPHAN_WAIT_S = 120.0
"""How long to wait for the command's orphans (a forkserver exits once pytest has)."""


@dataclass(frozen=True)
class Cost:
    """One run: its exit status, wall seconds, and user + system CPU seconds of every
    process of its tree, orphans included; ``left`` counts orphans still running when
    ``ORPHAN_WAIT_S`` ran out (their CPU is then missing)."""

    rc: int
    wall_s: float
    cpu_s: float
    left: int = 0


def become_subreaper() -> None:
    """Orphans of this process's descendants come to it rather than to init."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit(f"tree_cost: prctl(PR_SET_CHILD_SUBREAPER) failed with errno "
                         f"{ctypes.get_errno()}: the CPU of orphaned processes could not be "
                         "counted; run on Linux 3.4 or later")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _reap_orphans(deadline: float) -> int:
    """Wait for every remaining child (orphans handed here); how many still run at
    ``deadline``."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid:
            continue
        if time.monotonic() >= deadline:
            return _count_children()
        time.sleep(0.05)


def _count_children() -> int:
    me, count = str(os.getpid()), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[1] == me:
                count += 1
    return count


def run(command: Sequence[str], cwd: str | None = None,
        env: Mapping[str, str] | None = None) -> Cost:
    """Run ``command`` to its end and wait for its orphans; its ``Cost``. Call
    ``become_subreaper`` once first."""
    before = _children_cpu()
    start = time.monotonic()
    rc = subprocess.call(list(command), cwd=cwd, env=None if env is None else dict(env))
    left = _reap_orphans(time.monotonic() + ORPHAN_WAIT_S)
    return Cost(rc, time.monotonic() - start, _children_cpu() - before, left)


def _tree_env(tree: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.path.abspath(tree)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per tree (default 1)")
    ap.add_argument("--trees", nargs="+", default=None,
                    help="working trees to run the command in, alternately")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command to measure after --")
    become_subreaper()
    trees: list[str | None] = list(args.trees) if args.trees else [None]
    costs: dict[str | None, list[Cost]] = {t: [] for t in trees}
    failed = 0
    for i in range(args.repeat):
        for tree in trees:
            cost = run(command, cwd=tree, env=None if tree is None else _tree_env(tree))
            costs[tree].append(cost)
            failed += cost.rc != 0
            print(f"run {i + 1} {tree or '.'}: rc {cost.rc} wall {cost.wall_s:.1f} s "
                  f"cpu {cost.cpu_s:.1f} s" + (f" ({cost.left} orphans left)"
                                               if cost.left else ""), flush=True)
    for tree, runs in costs.items():
        print(f"median {tree or '.'} over {len(runs)}: "
              f"wall {statistics.median(c.wall_s for c in runs):.1f} s "
              f"cpu {statistics.median(c.cpu_s for c in runs):.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
