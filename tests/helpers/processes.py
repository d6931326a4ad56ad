"""Record the processes started in a stretch of code, without changing what it does.

``tests/conftest.py`` wraps every test in ``recording_processes`` to fail a test that starts
a process (a ``subprocess`` or a ``multiprocessing`` process, e.g. the ranks of
``tests.helpers.dist.run_ranks``) without ``@pytest.mark.multiproc``, so
``-m "not multiproc"`` runs in the test process alone.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import subprocess
from collections.abc import Iterator
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
