"""``smp_fx.cli.torchrun``: the agent ends without the interpreter's teardown once torchrun
has returned, after its ``atexit`` handlers, with what it wrote and logged flushed. (The
launches themselves: ``test_run.py``, ``test_run_faults.py``, ``test_run_nodes.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# A module-level object whose finaliser speaks: the interpreter's teardown runs it.
SCRIPT = """
import atexit, logging, sys
from smp_fx.cli.torchrun import exit_without_teardown

class Spoken:
    def __del__(self):
        sys.stdout.write("torn down\\n")

kept = Spoken()
atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
logging.getLogger("agent").info("logged")
sys.stdout.write("written\\n")
{end}(3)
"""


def _run(end: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # pipes buffer
    return subprocess.run([sys.executable, "-c", SCRIPT.format(end=end)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.multiproc
def test_agent_exit_keeps_code_atexit_and_output_and_skips_teardown() -> None:
    fast, normal = _run("exit_without_teardown"), _run("sys.exit")
    assert normal.returncode == fast.returncode == 3, (normal.stderr, fast.stderr)
    assert normal.stdout.splitlines() == ["written", "atexit ran", "torn down"]
    assert fast.stdout.splitlines() == ["written", "atexit ran"]  # no teardown
    assert fast.stderr.splitlines()[-1:] == ["logged"] == normal.stderr.splitlines()[-1:]
