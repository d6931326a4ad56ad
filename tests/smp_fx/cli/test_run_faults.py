"""``smp-fx run`` when a rank stops: a stuck rank is told by every rank's flight record and the
launcher's summary; a rank killed mid-step under ``--max-restarts`` is restarted and the run
resumes from its last checkpoint to the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_script

REPO = Path(__file__).resolve().parents[3]

HANG_SCRIPT = """
import os, time
import torch
from torch import nn
import smdistributed.modelparallel.torch as smp

smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
# a short bound for the pipeline's waits only: a slow start on a loaded machine is not a fault
os.environ["SMP_FX_TIMEOUT_S"] = os.environ["PIPELINE_TIMEOUT_S"]
torch.set_num_threads(1)
torch.manual_seed(0)  # both pipeline ranks are given the same batches
model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))

@smp.step
def train(model, x, k):
    if k == 2 and smp.rank() == 1:
        time.sleep(300)  # alive, but the step stops here
    out = model(x)
    model.backward(out.sum())
    return out

for k in range(3):
    train(model, torch.randn(4, 4), k)
"""


@contextmanager
def _launch(args: list[str], cwd: Path, **env: str) -> Iterator[subprocess.Popen[str]]:
    """``smp-fx run -n 2`` with ``args``; killed on leaving if it still runs (a failure or
    a timeout while waiting on it)."""
    proc = subprocess.Popen([sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2", *args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SMP_FX_TIMEOUT_S": "60", **env})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    out, err = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    with _launch(args, cwd, **env) as proc:
        return _finish(proc)


@pytest.mark.multiproc
def test_a_stuck_rank_is_named_by_every_log(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(textwrap.dedent(HANG_SCRIPT))
    dump = tmp_path / "dump"
    res = _run(["hang.py"], tmp_path, PIPELINE_TIMEOUT_S="4", SMP_FX_DUMP_DIR=str(dump))
    err = res.stderr
    assert res.returncode != 0
    assert "SMPTimeoutError: stage 1 (rank 1) sent nothing for 4 s" in err, err[-3000:]
    assert "at rank 0 (stage 0) in step 2, while receiving" in err
    stuck = (dump / "flight_rank1.txt").read_text()  # told by its watchdog
    assert "smp-fx flight record of rank 1 (stage 1), step 2: no progress" in stuck
    assert "mb0 running user code before model(...)" in stuck
    waiting = (dump / "flight_rank0.txt").read_text()
    assert "  at: receiving the gradients of microbatch 0 from stage 1 (rank 1)" in waiting
    assert "smp-fx run: attempt0: rank 1 (stage 1) stopped first: no progress" in err, err[-2000:]


@pytest.mark.multiproc
def test_killed_mid_step_restarts_and_resumes_to_the_uninterrupted_result(tmp_path: Path
                                                                          ) -> None:
    script = str(REPO / "examples" / "train_resume.py")
    with _launch(["--max-restarts", "1", script, "--ckpt", str(tmp_path / "ck.pt"), "--steps",
                  "5", "--crash-at", "2", "--out", str(tmp_path / "final.pt")],
                 tmp_path) as launch:  # the reference, one process, runs while the launch does
        run_script(script, "--ckpt", str(tmp_path / "ref.pt"), "--steps", "5", "--out",
                   str(tmp_path / "ref_final.pt"), timeout=120)
        res = _finish(launch)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 0: resumed at step 2" in res.stdout and "rank 1: resumed at step 2" in res.stdout
    assert "smp-fx run: attempt0: " in res.stderr  # the line names rank 1 if rank 0 reported
    want, got = torch.load(tmp_path / "ref_final.pt"), torch.load(tmp_path / "final.pt")
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
