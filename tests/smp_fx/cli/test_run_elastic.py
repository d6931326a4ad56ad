"""``smp-fx run --nnodes 1:2`` loses a node and goes on: two launchers of 2 processes train at
pp 2 x dp 2 (``examples/train_elastic.py``, a checkpoint every 2 steps); one launcher's node
is killed at step 5; the other restarts alone at pp 2 x dp 1 from the step-4 checkpoint with
no command typed; a returning launcher grows the job back to dp 2 from the newest
checkpoint; the parameters after step 10 equal plain PyTorch's on the same global batches."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import free_port

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "train_elastic.py"
# a dead node is dropped after 5 missed 1 s heartbeats; a round waits 8 s for late nodes
RDZV_CONF = "last_call_timeout=8,keep_alive_interval=1,keep_alive_max_attempt=5"
RESTART_BOUND_S = 60.0  # from the kill to the survivors' resume


def _launcher(tmp: Path, port: int, name: str, doomed: bool = False
              ) -> subprocess.Popen[bytes]:
    """A launcher; "a", the survivor, hosts the rendezvous, which must outlive the others."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SMP_FX_TIMEOUT_S": "120"}
    if doomed:
        env["ELASTIC_DOOMED"] = "1"
    with open(tmp / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2", "--nnodes", "1:2",
             "--rdzv-backend", "c10d", "--rdzv-id", "elastic", "--rdzv-conf",
             f"{RDZV_CONF},is_host={int(name == 'a')}",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "3", str(SCRIPT),
             "--ckpt", str(tmp / "ck"), "--steps", "10", "--stall-at", "5", "--hold-at", "7",
             "--out", str(tmp / "final.pt")],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted(tmp.glob("*.log")))


def _wait(cond: Callable[[], bool], seconds: float, what: str, tmp: Path) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {seconds:.0f} s\n{_logs(tmp)}")
        time.sleep(0.2)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.multiproc
def test_loses_a_node_goes_on_at_dp1_and_grows_back(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    port = free_port()
    log_a = tmp_path / "a.log"
    started: list[subprocess.Popen[bytes]] = []
    try:
        # b waits for a's rendezvous, so both join its first round
        started += [_launcher(tmp_path, port, "b", doomed=True), _launcher(tmp_path, port, "a")]
        markers = lambda: sorted((tmp_path / "ck").glob("doomed_*"))  # noqa: E731
        _wait(lambda: len(markers()) == 2, 180, "node b's processes at step 5", tmp_path)
        pids = [int(p.read_text()) for p in markers()]
        _kill_group(started[0])
        for pid in pids:  # torchelastic starts each worker in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        resumed = "resumed after step 4 at dp 1"
        _wait(lambda: log_a.read_text().count(resumed) == 2, 180, "the survivors' resume",
              tmp_path)
        restart_s = time.monotonic() - killed
        _wait(lambda: (tmp_path / "ck" / "step6_partial").is_dir(), 120, "step 6's checkpoint",
              tmp_path)
        started.append(_launcher(tmp_path, port, "c"))
        for proc in started[1:]:
            proc.wait(timeout=240)
        assert [p.returncode for p in started[1:]] == [0, 0], _logs(tmp_path)
    finally:
        for proc in started:
            _kill_group(proc)
    a, c = log_a.read_text(), (tmp_path / "c.log").read_text()
    assert restart_s < RESTART_BOUND_S, (restart_s, _logs(tmp_path))
    assert ("smp-fx elastic: 2 of 4 processes: pp 2 x tp 1 kept, dp 1 (full 2); "
            "microbatches 2 -> 4") in a
    grown = "resumed after step 6 at dp 2"
    assert a.count(grown) == 2 and c.count(grown) == 2, _logs(tmp_path)
    from examples.train_elastic import reference

    want, got = reference(10), torch.load(tmp_path / "final.pt")
    assert list(got) == list(want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
