"""Failure reports: the rank that failed first is found by following who waited on whom."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import smp_fx as smp
from smp_fx.world import reports


def _put(directory: Path, rank: int, kind: str, **fields: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}.{kind}.json").write_text(json.dumps({"rank": rank, **fields}))


def _started(directory: Path, n: int) -> None:
    for r in range(n):
        _put(directory, r, "started", stage=r, pid=100 + r, time=0.0)


def test_writers_follow_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(reports.ENV, raising=False)
    reports.started(0, 0)  # outside smp-fx run: nothing, nowhere
    assert reports.attempt_dir() is None
    monkeypatch.setenv(reports.ENV, str(tmp_path))
    monkeypatch.setenv(reports.RESTART_ENV, "2")
    reports.started(3, 1)
    err = smp.SMPPeerError("lost the connection to stage 0 (rank 1)")
    err.peer_rank = 1
    reports.failed(3, [1], err)
    reports.failed(3, [1], ValueError("later errors do not replace the first"))
    got = json.loads((tmp_path / "attempt2" / "rank3.failed.json").read_text())
    assert got["error"] == "SMPPeerError" and got["peer_rank"] == 1
    assert json.loads((tmp_path / "attempt2" / "rank3.started.json").read_text())["stage"] == 1


def test_a_killed_rank_is_found_through_the_ranks_that_lost_it(tmp_path: Path) -> None:
    d = tmp_path / "attempt0"
    _started(d, 4)
    _put(d, 3, "failed", time=2.0, error="SMPPeerError", message="lost rank 2", peer_rank=2)
    _put(d, 2, "failed", time=1.0, error="SMPPeerError", message="lost rank 1", peer_rank=1)
    line = reports.first_failure(d, {1: -9, 0: -15})
    assert line == ("rank 1 (stage 1) failed first: its process was killed by SIGKILL; rank 2, "
                    "then rank 3 failed because of it")


def test_killed_rank_without_any_report_comes_from_the_exit_codes(tmp_path: Path) -> None:
    d = tmp_path / "attempt0"
    _started(d, 2)  # rank 0 was stopped by the launcher before it could report
    assert reports.first_failure(d, {0: -15, 1: -9}) == (
        "rank 1 (stage 1) failed first: its process was killed by SIGKILL")
    assert reports.first_failure(d, {}) is None


def test_a_stalled_rank_is_named_with_what_it_was_at(tmp_path: Path) -> None:
    d = tmp_path / "attempt0"
    _started(d, 2)
    _put(d, 0, "failed", time=5.0, error="SMPTimeoutError", message="stage 1 sent nothing",
         peer_rank=1)
    _put(d, 1, "stalled", time=4.5, record="smp-fx flight record ...\n  at: x\n  next op 1F0: "
         "waiting for microbatch 0's step function to call model(...)\n")
    assert reports.first_failure(d, {0: 1}) == (
        "rank 1 (stage 1) stopped first: no progress in its step (next op 1F0: waiting for "
        "microbatch 0's step function to call model(...)); rank 0 failed because of it")


def test_an_error_of_its_own_is_the_first_failure(tmp_path: Path) -> None:
    d = tmp_path / "attempt0"
    _started(d, 2)
    _put(d, 1, "failed", time=1.0, error="ValueError", message="bad batch\nmore", peer_rank=None)
    _put(d, 0, "failed", time=1.5, error="SMPPeerError", message="lost", peer_rank=1)
    assert reports.first_failure(d) == ("rank 1 (stage 1) failed first: ValueError: bad batch; "
                                        "rank 0 failed because of it")


def test_summary_has_a_line_per_failed_attempt(tmp_path: Path) -> None:
    _started(tmp_path / "attempt0", 2)
    _put(tmp_path / "attempt0", 0, "failed", time=1.0, error="SMPPeerError", message="lost",
         peer_rank=1)
    _started(tmp_path / "attempt1", 2)  # the restart went through
    reports.record_exits(tmp_path, {})
    assert reports.summary(tmp_path) == [
        "attempt0: rank 1 (stage 1) failed first: its process left no report (killed?); rank 0 "
        "failed because of it"]


def test_excepthook_reports_then_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(reports.ENV, str(tmp_path))
    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: printed.append(a[1]))
    reports.install_excepthook(1, 1)
    exc = KeyError("k")
    sys.excepthook(KeyError, exc, None)
    assert printed == [exc]
    assert json.loads((tmp_path / "attempt0" / "rank1.failed.json").read_text())["error"] \
        == "KeyError"
