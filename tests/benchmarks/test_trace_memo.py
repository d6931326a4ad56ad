"""benchmarks/trace_memo.py: a run on two architectures reuses the program on both and says
so, with no fallback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trace_memo as bench  # noqa: E402

from passes import trace_memo  # noqa: E402


@pytest.mark.usefixtures("one_thread")
def test_two_architectures_reuse_their_programs(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trace_memo.ENV, raising=False)
    rows = bench.main(["--archs", "llama", "bert", "--rounds", "1"])
    trace_memo.clear()
    assert [r["arch"] for r in rows] == ["llama", "bert"]
    assert all(r["reused"] and not r["unkeyed"] for r in rows), rows
    assert all(0 < r["second_s"] < r["first_s"] for r in rows), rows
    out = capsys.readouterr().out
    assert "reused on 2 of 2 architectures; exported without a key (fallback) on 0" in out
