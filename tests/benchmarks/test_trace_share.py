"""benchmarks/trace_share.py: a run on two architectures hands both graphs on, each
rebuilt exactly and loaded for less than its export, and says there was no fallback."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trace_share as bench  # noqa: E402

from passes import trace_memo, trace_share  # noqa: E402


@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(trace_share.available() is not None, reason=str(trace_share.available()))
def test_two_architectures_are_handed_on(capsys: pytest.CaptureFixture[str]) -> None:
    before = os.environ.get(trace_memo.ENV)
    rows = bench.main(["--archs", "llama", "bert", "--rounds", "1"])
    assert os.environ.get(trace_memo.ENV) == before  # the benchmark put the switch back
    assert [r["arch"] for r in rows] == ["llama", "bert"]
    assert all(r["fallback"] is None and r["exact"] for r in rows), rows
    assert all(0 < r["from_bytes"] < r["export"] for r in rows), rows
    assert "handed on: 2 of 2 architectures (fallbacks 0)" in capsys.readouterr().out
