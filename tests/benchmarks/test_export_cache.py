"""benchmarks/export_cache.py: a new process loads the graphs this one stored, each
computing its own model's output exactly for less than its export, and says there was no
fallback."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import export_cache as bench  # noqa: E402

from passes import export_cache, trace_share  # noqa: E402


@pytest.mark.multiproc
@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(trace_share.available() is not None, reason=str(trace_share.available()))
def test_a_new_process_loads_both_architectures(capsys: pytest.CaptureFixture[str]) -> None:
    before = os.environ.get(export_cache.ENV)
    rows = bench.main(["--archs", "llama", "bert"])
    assert os.environ.get(export_cache.ENV) == before  # the benchmark put the switch back
    assert [r["arch"] for r in rows] == ["llama", "bert"]
    assert all(r["loaded"] and r["exact"] and not r["missed"] for r in rows), rows
    assert all(0 < r["restart"] < r["export"] for r in rows), rows
    assert "loaded in the new process: 2 of 2 architectures (fallbacks 0)" in \
        capsys.readouterr().out
