"""Bad checkpoints: each way a file can be wrong is one clear error naming the file and the
fix, and a load that fails on one rank fails on every rank."""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import smp_fx as smp
from smp_fx.ckpt import files, layout, validate
from smp_fx.ckpt.commit import save_partial
from smp_fx.ckpt.files import load_partial_set
from smp_fx.ckpt.ranks import RankInfo
from smp_fx.ckpt.view import Ranks
from tests.helpers.threads import run_thread_ranks


class NotAllowed:
    """A class the safe loader refuses."""


def _good(path: Path) -> None:
    torch.save({"w": torch.randn(64, 64)}, path)


@pytest.mark.parametrize("make, rule", [
    (lambda p: p.write_bytes(b""), "the checkpoint file is empty"),
    (lambda p: (_good(p), p.write_bytes(p.read_bytes()[:3000])),
     "the checkpoint file is truncated: its end is missing"),
    (lambda p: p.write_text("hello\n"), "the file is not a checkpoint"),
    (lambda p: p.write_text('{"format": "smp-fx-partial-checkpoint"}'),
     "the file is not a checkpoint"),
    (lambda p: p.write_bytes(pickle.dumps({"w": 1}, protocol=2)), "the file is not a checkpoint"),
    (lambda p: torch.save({"obj": NotAllowed()}, p), "objects the safe (weights_only) loader"),
])
def test_a_bad_file_says_what_is_wrong(tmp_path: Path, make: Any, rule: str) -> None:
    path = tmp_path / "ckpt.pt"
    make(path)
    with pytest.raises(smp.SMPCheckpointError) as info:
        smp.load(str(path), partial=False)
    assert rule in str(info.value) and str(path) in str(info.value)
    assert "Fix:" in str(info.value)


def test_a_partial_checkpoint_loaded_as_full_says_so(tmp_path: Path) -> None:
    _good(tmp_path / "ck.pt_0")
    with pytest.raises(smp.SMPCheckpointError, match="load it with partial=True"):
        smp.load(str(tmp_path / "ck.pt"), partial=False)


def _save_set(prefix: str, value: float) -> None:
    """Two ranks (threads) save a partial checkpoint with an index."""
    def fn(rank: int, gather: Any) -> None:
        save_partial({"w": torch.full((2,), value + rank)}, prefix,
                     RankInfo(mp_rank=rank, num_files=2, pp_degree=2, pp_rank=rank), gather)
    assert run_thread_ranks(2, fn) == [None, None]


def test_a_missing_rank_file_is_named(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck.pt")
    _save_set(prefix, 0.0)
    assert [o["w"][0].item() for o in load_partial_set(prefix)[1]] == [0.0, 1.0]
    os.unlink(prefix + "_1")
    with pytest.raises(smp.SMPCheckpointError, match="model-parallel rank 1 of this partial "
                                                     "checkpoint is missing") as info:
        load_partial_set(prefix)
    assert prefix + "_1" in str(info.value)


def test_files_of_different_saves_do_not_mix(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    _save_set(a, 0.0)
    _save_set(b, 5.0)
    shutil.copy(b + "_1", a + "_1")
    with pytest.raises(smp.SMPCheckpointError, match="files come from different saves"):
        load_partial_set(a)


def test_a_damaged_index_is_named(tmp_path: Path) -> None:
    prefix = str(tmp_path / "ck.pt")
    _save_set(prefix, 0.0)
    Path(layout.index_path(prefix)).write_text('{"format": "smp-fx-partial')
    with pytest.raises(smp.SMPCheckpointError, match="the checkpoint index cannot be read"):
        smp.load(prefix)


def test_unindexed_files_of_other_degrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    prefix = str(tmp_path / "ck.pt")
    for r in range(3):  # SMP's own partial files: no index
        torch.save({"w": torch.zeros(1)}, f"{prefix}_{r}")
    two = RankInfo(mp_rank=1, num_files=2, pp_degree=2, pp_rank=1)
    monkeypatch.setattr(files, "current_rank", lambda ranks: (two, lambda v: [v]))
    with pytest.raises(smp.SMPCheckpointError, match="more files than this job has"):
        smp.load(prefix)
    os.unlink(f"{prefix}_2")
    torch.save({layout.WRAP_KEY: 1, "save_id": "x", "mp_rank": 0, "object": {}}, f"{prefix}_1")
    with pytest.raises(smp.SMPCheckpointError, match="belongs to another model-parallel rank"):
        smp.load(prefix)


@dataclass(frozen=True)
class _FakeWorld(Ranks):
    """Rank 0 of a world whose ranks report what ``reports`` returns."""

    reports: Callable[[Any], list[Any]] | None = None

    def world_gather(self) -> Callable[[Any], list[Any]] | None:
        return self.reports


def _fake_world(others: list[Any]) -> Ranks:
    """This rank is rank 0 of a world whose other ranks report ``others``."""
    return _FakeWorld(reports=lambda mine: [mine, *others])


def test_a_failure_on_another_rank_fails_this_one() -> None:
    world = _fake_world([None, "the checkpoint file is empty (got 'ck.pt_2')"])
    with pytest.raises(smp.SMPCheckpointError) as info:
        validate.agreed("smp.load('ck.pt')", lambda: {"w": 1}, world)
    assert str(info.value) == ("smp.load('ck.pt') failed on 1 of 3 rank(s) (this rank's part "
                               "loaded); rank 2: the checkpoint file is empty (got 'ck.pt_2')")
    assert validate.agreed("x", lambda: 7, _fake_world([None])) == 7


def test_this_ranks_own_failure_is_shared_and_raised() -> None:
    seen: list[Any] = []

    def gather(mine: Any) -> list[Any]:
        seen.append(mine)
        return [mine, None]

    def bad() -> None:
        raise KeyError("w")

    with pytest.raises(smp.SMPCheckpointError, match="rank 0: KeyError: 'w'") as info:
        validate.agreed("load", bad, _FakeWorld(reports=gather))
    assert seen == ["KeyError: 'w'"] and isinstance(info.value.__cause__, KeyError)


def test_a_world_of_one_raises_its_error_as_it_is() -> None:
    err = smp.SMPCheckpointError("the checkpoint file is empty")

    def bad() -> None:
        raise err

    with pytest.raises(smp.SMPCheckpointError) as info:
        validate.agreed("load", bad, Ranks())
    assert info.value is err
