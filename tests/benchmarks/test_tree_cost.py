"""``benchmarks/tree_cost.py`` counts the CPU of orphaned descendants (a forkserver's)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# forks a grandchild and exits at once: the grandchild, orphaned, burns CPU
ORPHAN_BURNS = textwrap.dedent("""
    import os, time
    if os.fork() == 0:
        end = time.process_time() + {burn}
        while time.process_time() < end:
            pass
        os._exit(0)
""")


def _cpu(burn: float) -> float:
    """The script's CPU figure for ORPHAN_BURNS (run in a process of its own: the script
    makes itself a subreaper, which this test process must not become)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tree_cost.py"), "--",
                          sys.executable, "-c", ORPHAN_BURNS.format(burn=burn)],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    found = re.search(r"^median \. over 1: wall [\d.]+ s cpu ([\d.]+) s$", out, re.M)
    assert found and "orphans left" not in out, out
    return float(found.group(1))


@pytest.mark.multiproc
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_an_orphans_cpu_is_counted() -> None:
    assert _cpu(0.8) - _cpu(0.0) >= 0.7  # the orphan's 0.8 s, not only its parent's
