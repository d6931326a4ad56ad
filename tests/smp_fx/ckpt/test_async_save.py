"""Asynchronous checkpoints: the same files as a synchronous save of the same moment
(partial and full, training going on meanwhile), a failed write raised at the next step on
every rank with the previous checkpoint kept, and a rank killed while writing: the previous
checkpoint loads and the resumed run equals the uninterrupted one."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import smp_fx as smp
from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt import async_save, checkpoint_api
from smp_fx.ckpt.atomic import atomic_write
from tests.helpers.ckpt import assert_same
from tests.helpers.dist import run_ranks
from tests.helpers.numerics import init
from tests.smp_fx.ckpt.test_checkpoint_api import Run


def _read(file: str) -> Any:
    data = torch.load(file, weights_only=False)
    if isinstance(data, dict):
        data.pop("save_id", None)  # each save has its own id
    return data


def _assert_same_folders(a: str, b: str) -> None:
    names = sorted(n for n in os.listdir(a) if not n.endswith(".json"))
    assert names == sorted(n for n in os.listdir(b) if not n.endswith(".json")), (a, b)
    for name in names:
        assert_same(_read(os.path.join(a, name)), _read(os.path.join(b, name)), name)


def _same_as_sync(path: str, pp: int, **config: Any) -> list[str]:
    """Sync and async saves of the same moment, partial and full, with steps in between
    (which change the live tensors); returns ``newest``."""
    init(pp, 2, "interleaved", **config)
    run = Run(seed=0)
    run.step(1)
    smp.save_checkpoint(path, "s", model=run.model, optimizer=run.opt, user_content={"n": 1})
    smp.save_checkpoint(path, "a", model=run.model, optimizer=run.opt, user_content={"n": 1},
                        async_save=True)
    run.step(2)  # while "a" is written: the copy was taken at the call
    smp.save_checkpoint(path, "fa", partial=False, model=run.model, async_save=True)
    assert async_save.in_flight() == "fa"  # "a" was waited for and committed
    smp.save_checkpoint(path, "fs", partial=False, model=run.model)  # waits for "fa"
    run.step(3)
    smp.wait_checkpoint()
    assert async_save.in_flight() is None
    if smp.rank() == 0:
        _assert_same_folders(os.path.join(path, "s_partial"), os.path.join(path, "a_partial"))
    if smp.rank() == 0:
        assert_same(_read(os.path.join(path, "fs")), _read(os.path.join(path, "fa")))
    return checkpoint_api.read_newest(path)


def _failing_writer(path: str, writer: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device (simulated)", path)


def _write_error(path: str, failing_rank: int) -> str:
    """A write fails on ``failing_rank``: every rank raises at its next step, the previous
    checkpoint stays the newest and loads (smp initialised by the caller)."""
    async_save.HOLD_S = 0.0  # no step comes until the write is done: write at once
    run = Run(seed=0)
    run.step(1)
    smp.save_checkpoint(path, "ok", model=run.model, optimizer=run.opt, async_save=True)
    smp.wait_checkpoint()
    if smp.rank() == failing_rank:
        async_save.write_file = _failing_writer  # type: ignore[assignment]
    smp.save_checkpoint(path, "second", model=run.model, optimizer=run.opt, async_save=True)
    async_save._inflight.done.wait(60)  # type: ignore[union-attr]
    with pytest.raises(SMPCheckpointError, match="No space left") as info:
        run.step(2)
    assert checkpoint_api.read_newest(path) == ["ok_partial"]
    smp.resume_from_checkpoint(path)
    return str(info.value)


def _commit_error(path: str) -> tuple[str, int]:
    """World rank 0's commit, on its own thread, fails: every rank raises it within the
    next steps (returns the message and the steps it took), the previous checkpoint kept."""
    run = Run(seed=0)
    run.step(1)
    smp.save_checkpoint(path, "ok", model=run.model, optimizer=run.opt, async_save=True)
    smp.wait_checkpoint()

    def failing(*_: Any) -> None:
        raise OSError(errno.EIO, "Input/output error (simulated)", path)

    if smp.rank() == 0:
        checkpoint_api.commit = failing  # type: ignore[assignment]
    smp.save_checkpoint(path, "second", model=run.model, optimizer=run.opt, async_save=True)
    for n in range(2, 12):  # written, then committed: a few steps, alike on every rank
        try:
            run.step(n)
        except SMPCheckpointError as exc:
            assert checkpoint_api.read_newest(path) == ["ok_partial"]
            return str(exc), n
    raise AssertionError("the commit's failure was never raised")


def _grid_body(path: str) -> dict[str, Any]:
    """pp 2 x dp 2: async equals sync; then a full disk on rank 1 only; then a failed
    commit on rank 0."""
    newest = _same_as_sync(os.path.join(path, "same"), 2, ddp=True)
    smp.reset()
    commit = checkpoint_api.commit
    try:
        told = _write_error(os.path.join(path, "err"), 1)
        async_save.write_file = checkpoint_api.atomic_write
        smp.reset()
        committed = _commit_error(os.path.join(path, "commit"))
    finally:
        async_save.write_file = checkpoint_api.atomic_write
        checkpoint_api.commit = commit
    return {"newest": newest, "told": told, "committed": committed}


@pytest.mark.multiproc
def test_pp2_dp2_async_equals_sync_a_full_disk_on_one_rank_and_a_failed_commit(
        tmp_path: Path) -> None:
    results = run_ranks(_grid_body, 4, str(tmp_path), timeout=240)
    for r in results:
        assert r["newest"] == ["s_partial", "a_partial"]
        assert "rank 1: [Errno 28]" in r["told"] and "rank 0:" not in r["told"]
        said, step = r["committed"]
        assert "not committed" in said and "rank 0: [Errno 5]" in said, said
        assert "rank 1:" not in said
    assert len({r["committed"][1] for r in results}) == 1  # the same step on every rank


def _sharded_body(path: str) -> dict[str, Any]:
    newest = _same_as_sync(path, 1, ddp=True, sharded_data_parallel_degree=2)
    return {"newest": newest, "files": sorted(os.listdir(os.path.join(path, "a_partial")))}


@pytest.mark.multiproc
def test_sharded_data_parallel_async_equals_sync(tmp_path: Path) -> None:
    """sdp 2 at pp 1: whole tensors gathered at the call, SMP's DeepSpeed-named files too."""
    for r in run_ranks(_sharded_body, 2, str(tmp_path), timeout=240):
        assert r["newest"] == ["s_partial", "a_partial"]
        assert {"model_0.pt", "optimizer_0.pt", "optimizer_1.pt"} <= set(r["files"])


def _killed_body(path: str) -> None:
    """Rank 1 is killed while its part of the second checkpoint is being written."""
    init(2, 2, "interleaved")
    run = Run(seed=0)
    run.step(1)
    smp.save_checkpoint(path, "first", model=run.model, optimizer=run.opt, async_save=True)
    smp.wait_checkpoint()
    torch.save(run.model.local_state_dict(), os.path.join(path, f"want{smp.rank()}.pt"))
    run.step(2)
    if smp.rank() == 1:
        def killed(file: str, writer: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)
        async_save.write_file = killed  # type: ignore[assignment]
    smp.save_checkpoint(path, "second", model=run.model, optimizer=run.opt, async_save=True)
    run.step(3)
    smp.wait_checkpoint()  # rank 0 has lost its peer by now


@pytest.mark.multiproc
def test_a_rank_killed_while_writing_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = str(tmp_path)
    with pytest.raises(Exception, match="rank 0"):
        run_ranks(_killed_body, 2, path, timeout=60, may_die=(1,))
    assert checkpoint_api.read_newest(path) == ["first_partial"]
    assert os.path.isdir(os.path.join(path, ".second_partial.incomplete"))
    loaded = smp.load(os.path.join(path, "first_partial", "model.pt"), partial=True)
    for r in (0, 1):
        want = torch.load(os.path.join(path, f"want{r}.pt"), weights_only=True)
        for name, value in want.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


EXITING = """
import sys
import smp_fx as smp
from tests.helpers.numerics import init
from tests.smp_fx.ckpt.test_checkpoint_api import Run

init(2, 2, "interleaved")
run = Run(seed=0)
run.step(1)
smp.save_checkpoint(sys.argv[1], "last", model=run.model, optimizer=run.opt, async_save=True)
"""


@pytest.mark.multiproc
def test_process_exit_waits_for_the_write_and_commits(tmp_path: Path) -> None:
    """A script that ends right after an asynchronous save: the save is written and
    committed at exit."""
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path)], cwd=repo,
                          env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert checkpoint_api.read_newest(str(tmp_path)) == ["last_partial"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert not [n for n in os.listdir(tmp_path / "last_partial") if n.startswith(".done")]


K, N = 2, 6  # the checkpoint that stays the newest; the step both runs reach
_held, _release = threading.Event(), threading.Event()


def _held_write(path: str, writer: Any) -> None:
    """Test-only stand-in for ``async_save.write_file``: half of the file's bytes go into
    its temporary, then the write is held (``_held`` set) until released or the rank dies;
    so the kill below lands deterministically while the write is in flight."""
    whole = io.BytesIO()
    writer(whole)

    def half(fh: Any) -> None:
        fh.write(whole.getvalue()[: whole.tell() // 2])
        fh.flush()
        _held.set()
        assert _release.wait(60), "the held write was never released"

    atomic_write(path, half)


def _killed_in_flight_body(path: str) -> None:
    """pp 2: async saves at steps K and K + 2; rank 1 is SIGKILLed while its write of the
    second is held half-written; rank 0 (its own part written) fails on its lost peer."""
    init(2, 2, "interleaved")
    run = Run(seed=0)
    for n in range(1, K + 3):
        run.step(n)
        if n == K:
            smp.save_checkpoint(path, f"step{n}", model=run.model, optimizer=run.opt,
                                user_content={"step": n}, async_save=True)
            smp.wait_checkpoint()
    if smp.rank() == 1:
        async_save.write_file = _held_write  # type: ignore[assignment]
        async_save.HOLD_S = 0.0  # no step comes until the write is held: write at once
    smp.save_checkpoint(path, f"step{K + 2}", model=run.model, optimizer=run.opt,
                        user_content={"step": K + 2}, async_save=True)
    if smp.rank() == 1:
        assert _held.wait(60), "the write was never held"
        os.kill(os.getpid(), signal.SIGKILL)
    smp.wait_checkpoint()


def _resumed_and_uninterrupted_body(path: str) -> int:
    """A fresh launch resumes from the newest complete checkpoint and trains to step N,
    then saves again under the tag the killed save left half-written; an uninterrupted run
    trains steps 1..N; this rank's parameters of both are compared (returns their count)."""
    init(2, 2, "interleaved")
    resumed = Run(seed=1)  # other initial weights: all must come from the checkpoint
    assert smp.resume_from_checkpoint(path)["step"] == K
    for n in range(K + 1, N + 1):
        resumed.step(n)
    smp.save_checkpoint(path, f"step{K + 2}", model=resumed.model, optimizer=resumed.opt,
                        user_content={"step": N}, async_save=True)
    smp.wait_checkpoint()
    smp.reset()
    straight = Run(seed=0)
    for n in range(1, N + 1):
        straight.step(n)
    got, want = resumed.params(), straight.params()
    assert list(got) == list(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)
    return len(want)


@pytest.mark.multiproc
def test_a_rank_killed_in_flight_resumes_from_the_previous_and_equals_uninterrupted(
        tmp_path: Path) -> None:
    path = str(tmp_path)
    with pytest.raises(Exception, match="rank 0"):
        run_ranks(_killed_in_flight_body, 2, path, timeout=60, may_die=(1,))
    assert checkpoint_api.read_newest(path) == [f"step{K}_partial"]
    staging = os.path.join(path, f".step{K + 2}_partial.incomplete")
    assert [n for n in os.listdir(staging) if n.endswith(".tmp")], "no half-written file"
    assert all(run_ranks(_resumed_and_uninterrupted_body, 2, path, timeout=120))
    assert checkpoint_api.read_newest(path) == [f"step{K}_partial", f"step{K + 2}_partial"]
    assert not os.path.exists(staging)
