"""Record the processes started in a stretch of code, without changing what it does.

``tests/conftest.py`` wraps every test in ``recording_processes`` to fail a test that starts
a process (a ``subprocess`` or a ``multiprocessing`` process, e.g. the ranks of
``tests.helpers.dist.run_ranks``) without ``@pytest.mark.multiproc``, so
``-m "not multiproc"`` runs in the test process alone.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def recording_processes() -> Iterator[list[str]]:
    """Within the block, every ``subprocess.Popen`` and ``multiprocessing`` process start
    appends a short description to the yielded list; the process starts as usual."""
    started: list[str] = []
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def recording_popen_init(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        started.append(f"subprocess {str(args)[:80]}")
        popen_init(self, args, *rest, **kwargs)

    def recording_start(self: Any) -> None:
        started.append(f"process {self.name}")
        process_start(self)

    subprocess.Popen.__init__ = recording_popen_init  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = recording_start  # type: ignore[method-assign]
    try:
        yield started
    finally:
        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = process_start  # type: ignore[method-assign]


def run_script_on_cpu(script: str, *args: str, cwd: Path, timeout: float = 300.0
                      ) -> subprocess.CompletedProcess[str]:
    """Run the repository's ``script`` (a path from its root) with the GPUs hidden, in its
    own process; fails the test with its output's tail when it exits non-zero."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(root / script), *args], capture_output=True,
                         text=True, env=env, timeout=timeout, cwd=cwd, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run
