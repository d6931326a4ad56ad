"""The check in tests/conftest.py that a test which starts processes is marked
``multiproc``: the recorder it relies on sees both ways a test starts one."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import recording_processes


@pytest.mark.multiproc
def test_the_recorder_sees_subprocesses_and_multiprocessing_processes() -> None:
    with recording_processes() as started:
        subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=120)
        proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
        proc.start()
        proc.join(timeout=120)
    assert proc.exitcode == 0
    assert len(started) == 2, started
    assert started[0].startswith("subprocess [") and started[1].startswith("process ")
    with recording_processes() as nothing:
        pass
    assert nothing == []
