"""The deferred copy of an asynchronous save: the next step's forward and backward run before
the copy is taken, the optimizer's step waits for it, and the checkpoint equals a
synchronous save of the same moment bit for bit."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import smp_fx as smp
from smp_fx.ckpt import async_save, checkpoint_api, snapshot
from tests.helpers.numerics import init
from tests.smp_fx.ckpt.test_async_save import _assert_same_folders
from tests.smp_fx.ckpt.test_checkpoint_api import Run


@pytest.fixture(autouse=True)
def _fresh(one_thread: None) -> None:
    init(2, 2, "interleaved")


@pytest.mark.parametrize("name", ["gpt", "hf_llama", "hf_bert", "cnn"])
def test_the_step_after_an_async_save_runs_before_its_copy_and_the_checkpoint_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    path = str(tmp_path)
    run = Run(seed=0, name=name)
    run.step(1)
    order: list[str] = []
    go = threading.Event()

    def held(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        assert go.wait(60), "the held copy was never released"
        order.append("copy")
        snapshot.copy_into.__wrapped__(pairs)  # type: ignore[attr-defined]

    held.__wrapped__ = snapshot.copy_into  # type: ignore[attr-defined]
    monkeypatch.setattr(snapshot, "copy_into", held)
    before = run.params()
    smp.save_checkpoint(path, "s", model=run.model, optimizer=run.opt)
    smp.save_checkpoint(path, "a", model=run.model, optimizer=run.opt, async_save=True)
    torch.manual_seed(1002)  # run.step(2), its optimizer step apart
    x, y = run.ex.example_inputs(4)[0], run.ex.example_targets(4)
    run.opt.zero_grad()
    run._train(run.model, x, y)
    order.append("backward")
    threading.Timer(0.3, go.set).start()  # the step below comes first unless it waits
    run.opt.step()
    order.append("optimizer step")
    smp.wait_checkpoint()
    after = run.params()
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the state moved on
    _assert_same_folders(os.path.join(path, "s_partial"), os.path.join(path, "a_partial"))
    assert order == ["backward", "copy", "optimizer step"]


def test_a_save_that_fails_after_its_copy_was_deferred_does_not_hold_the_optimizer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = Run(seed=0)
    run.step(1)

    def broken(*_: Any) -> Any:
        raise OSError("index entry failed (simulated)")

    monkeypatch.setattr("smp_fx.ckpt.checkpoint_api.index_entry", broken)
    with pytest.raises(smp.SMPCheckpointError, match="simulated"):
        smp.save_checkpoint(str(tmp_path), "a", model=run.model, optimizer=run.opt,
                            async_save=True)
    assert snapshot._copying is None
    run.step(2)  # would wait for a copy nobody takes


def test_the_writes_wait_for_the_step_after_the_one_that_starts_the_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step that starts a save carries its copy only; the next step's start releases
    the writes (``async_save.hold_writes``)."""
    monkeypatch.setattr(async_save, "HOLD_S", 60.0)
    written = threading.Event()
    real = async_save.write_file

    def recorded(path: str, writer: Any) -> None:
        written.set()
        real(path, writer)

    monkeypatch.setattr(async_save, "write_file", recorded)
    run = Run(seed=0)
    run.step(1)
    smp.save_checkpoint(str(tmp_path), "a", model=run.model, optimizer=run.opt,
                        async_save=True)
    run.step(2)
    assert snapshot._copying is None  # the copy was taken before its optimizer step
    assert not written.wait(0.5)
    run.step(3)
    assert written.wait(60)
    smp.wait_checkpoint()
    assert checkpoint_api.read_newest(str(tmp_path)) == ["a_partial"]


def test_an_invalid_tag_is_refused_by_the_asynchronous_call_with_nothing_left_in_flight(
        tmp_path: Path) -> None:
    run = Run(seed=0)
    run.step(1)
    with pytest.raises(smp.SMPCheckpointError, match="same non-empty file name"):
        smp.save_checkpoint(str(tmp_path), "", model=run.model, optimizer=run.opt,
                            async_save=True)
    assert async_save.in_flight() is None and snapshot._copying is None
    assert os.listdir(tmp_path) == []
    run.step(2)
