"""Flight records: what a rank's step did, in words, told on failure and by the watchdog."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import smp_fx as smp
from smp_fx.runtime.executor import flight
from smp_fx.runtime.executor.flight import FlightRecorder
from smp_fx.runtime.executor.lowering import Op

OPS = (Op("F", 0, 0), Op("SEND_ACT", 0, 0, 1), Op("F", 0, 1), Op("SEND_ACT", 0, 1, 1),
       Op("RECV_GRAD", 0, 0, 1), Op("B", 0, 0))


def test_record_lists_last_ops_with_times_and_what_it_waits_for() -> None:
    rec = FlightRecorder(0, [0], [0, 3], 20.0, status=lambda: ["step functions: mb0 x"])
    rec.begin(OPS)
    rec.begin(OPS)  # the second step
    for i in range(5):
        rec.mark(i)
    assert rec.where() == ("rank 0 (stage 0) in step 1, while receiving the gradients of "
                           "microbatch 0 from stage 1 (rank 3) for its backward pass")
    text = rec.record("a reason")
    lines = text.splitlines()
    assert lines[0] == "smp-fx flight record of rank 0 (stage 0), step 1: a reason"
    assert lines[1].startswith("  at: receiving the gradients of microbatch 0 from stage 1 "
                               "(rank 3) for its backward pass, for ")
    assert "  step functions: mb0 x" in lines
    assert sum(1 for x in lines if "0F0 " in x or "0F1 " in x) == 2
    assert any(x.startswith("  >") and "0RECV_GRAD0@1" in x for x in lines)
    assert lines[-1].strip() == "1 more op(s) to go, next: the backward pass of microbatch 0 " \
                                "on stage 0"
    rec.mark(len(OPS))
    assert rec.doing() == "waiting for its sends of the step to complete"
    rec.end()
    assert rec.where() == "rank 0 (stage 0) between steps"


def test_record_keeps_only_the_last_ops() -> None:
    ops = tuple(Op("F", 0, i) for i in range(20))
    rec = FlightRecorder(1, [0, 1], None, 5.0)
    rec.begin(ops)
    for i in range(15):
        rec.mark(i)
    shown = [x for x in rec.record("r").splitlines() if " 0F" in x]
    assert len(shown) == flight.LAST_OPS and "0F14" in shown[-1]
    assert rec.me() == "rank 1 (stage 0, stage 1)"


def test_tell_writes_stderr_and_dump_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SMP_FX_DUMP_DIR", str(tmp_path))
    rec = FlightRecorder(2, [1], [0, 2], 5.0)
    rec.begin(OPS)
    rec.failed(smp.SMPTimeoutError("stage 1 (rank 2) sent nothing"))
    rec.failed(smp.SMPTimeoutError("told once per step"))
    err = capsys.readouterr().err
    assert err.count("smp-fx flight record of rank 2 (stage 1), step 0") == 1
    assert (tmp_path / "flight_rank2.txt").read_text() == err
    rec.failed(ValueError("a user error is not a peer's"))
    assert capsys.readouterr().err == ""


def test_watchdog_tells_a_stalled_step_once(capsys: pytest.CaptureFixture[str]) -> None:
    rec = FlightRecorder(1, [1], [0, 1], 0.4, status=lambda: ["next op 1F0: waiting"])
    rec.begin(OPS)
    rec.watch()
    deadline = time.monotonic() + 10
    while "no progress" not in capsys.readouterr().err and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec._told_step == 0
    assert rec.stalled_for(time.monotonic()) == 0.0  # told: not again this step


def test_a_transfer_in_flight_is_not_a_stall() -> None:
    busy = [True]
    rec = FlightRecorder(0, [0], [0, 1], 1.0, busy=lambda: busy[0])
    rec.begin(OPS)
    rec.mark(4)  # RECV_GRAD: bounded by the transport's own timeout
    later = time.monotonic() + 5
    assert rec.stalled_for(later) == 0.0
    busy[0] = False  # nobody performs it: the step waits on user code
    assert rec.stalled_for(later) > 4.0
    rec.mark(len(OPS))  # the end of the step waits for sends: bounded too
    assert rec.stalled_for(later) == 0.0
    rec.end()
    assert rec.stalled_for(later) == 0.0
