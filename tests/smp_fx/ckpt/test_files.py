"""Tests for smp_fx.ckpt.files: naming, atomic writes, safe loading, the partial-save commit
protocol (ranks simulated by threads), resharding merges and a SIGKILL during a save."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import smp_fx
from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt import files as ckpt
from smp_fx.ckpt.commit import save_partial
from smp_fx.ckpt.layout import read_index
from smp_fx.ckpt.ranks import RankInfo
from smp_fx.ckpt.state_dict import PARTIAL_KEY
from tests.helpers.ckpt import kill_mid_save
from tests.helpers.threads import run_thread_ranks


class Custom:
    """Not a weights-only type: loading it needs weights_only=False."""

    def __init__(self, x: int) -> None:
        self.x = x


class Crash(Exception):
    pass


def crash_at(gather: Callable[[Any], list[Any]], call: int,
             after: bool) -> Callable[[Any], list[Any]]:
    """Die at the ``call``-th gather, before joining it or right after it returned."""
    count = [0]

    def wrapped(value: Any) -> list[Any]:
        count[0] += 1
        if count[0] == call and not after:
            raise Crash
        out = gather(value)
        if count[0] == call and after:
            raise Crash
        return out
    return wrapped


def stage_obj(rank: int, value: float) -> dict[str, Any]:
    model = {f"layer{rank}.weight": torch.full((2, 2), value), PARTIAL_KEY: True}
    return {"model_state_dict": model, "epoch": int(value)}


def save_two(f: str, value: float, wrap: dict | None = None) -> list[Any]:
    def fn(rank: int, gather: Callable[[Any], list[Any]]) -> None:
        info = RankInfo(mp_rank=rank, num_files=2, pp_degree=2, pp_rank=rank)
        save_partial(stage_obj(rank, value), f, info, gather)
    return run_thread_ranks(2, fn, wrap)


def test_full_save_is_plain_torch_file_and_leaves_no_temporaries(tmp_path: Path) -> None:
    f = str(tmp_path / "full.pt")
    obj = {"w": torch.arange(4.0), "step": 3}
    ckpt.save(obj, f, partial=False)
    assert torch.load(f, weights_only=True)["step"] == 3
    loaded = ckpt.load(f, partial=False)
    assert torch.equal(loaded["w"], obj["w"])
    assert sorted(os.listdir(tmp_path)) == ["full.pt"]
    with pytest.raises(SMPCheckpointError, match="file name"):
        ckpt.save(obj, open(f, "rb"), partial=False)  # noqa: SIM115
    with pytest.raises(SMPCheckpointError, match="partial=False"):
        ckpt.load(f, partial=True)


def test_weights_only_refusal_explains_opt_out(tmp_path: Path) -> None:
    f = str(tmp_path / "custom.pt")
    ckpt.save({"c": Custom(5)}, f, partial=False)
    with pytest.raises(SMPCheckpointError, match="weights_only=False"):
        ckpt.load(f, partial=False)
    assert ckpt.load(f, partial=False, weights_only=False)["c"].x == 5


def test_custom_pickle_module_needs_no_weights_only_flag(tmp_path: Path) -> None:
    """SMP's page passes pickle_module alone: that asks for the module's unpickler."""
    import pickle as std_pickle
    import types

    calls: list[str] = []

    class Unpickler(std_pickle.Unpickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls.append("used")
            super().__init__(*args, **kwargs)

    module = types.ModuleType("counting_pickle")
    module.__dict__.update({k: v for k, v in vars(std_pickle).items()
                            if not k.startswith("__")})
    module.Unpickler = Unpickler  # type: ignore[attr-defined]
    f = str(tmp_path / "custom.pt")
    ckpt.save({"c": Custom(7)}, f, partial=False, pickle_module=std_pickle)
    assert ckpt.load(f, partial=False, pickle_module=module)["c"].x == 7 and calls
    with pytest.raises(SMPCheckpointError, match="custom pickle_module cannot"):
        ckpt.load(f, partial=False, pickle_module=module, weights_only=True)


def test_what_scripts_save_loads_under_the_safe_default(tmp_path: Path) -> None:
    import numpy as np

    net = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(2, 3)).sum().backward()
    opt.step()
    scheds = [torch.optim.lr_scheduler.StepLR(opt, 2),
              torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s),
              torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10),
              torch.optim.lr_scheduler.ReduceLROnPlateau(opt)]
    obj = {"model": net.state_dict(), "opt": opt.state_dict(),
           "scheds": [s.state_dict() for s in scheds], "step": 3, "lr": 0.1, "name": "run",
           "flags": (True, None), "rng": torch.get_rng_state(), "np_rng": np.random.get_state(),
           "metric": np.float64(0.5), "hist": np.arange(3)}
    f = str(tmp_path / "script.pt")
    ckpt.save(obj, f, partial=False)
    loaded = ckpt.load(f, partial=False)  # weights_only: no opt-out needed
    assert loaded["step"] == 3 and loaded["metric"] == 0.5 and list(loaded["hist"]) == [0, 1, 2]
    assert loaded["opt"]["param_groups"][0]["lr"] == opt.state_dict()["param_groups"][0]["lr"]
    opt.load_state_dict(loaded["opt"])
    for sched, state in zip(scheds, loaded["scheds"]):
        sched.load_state_dict(state)


def test_v3_saves_a_partial_checkpoint_per_replica(tmp_path: Path) -> None:
    """What the Hugging Face Trainer passes: ``v3=smp.state.cfg.shard_optimizer_state``;
    SMP 1.10+'s ``smp.load(..., back_compat=True)`` reads it as any file."""
    f = str(tmp_path / "opt.pt")
    ckpt.save({"x": 1}, f, partial=True, v3=True)
    assert sorted(os.listdir(tmp_path)) == ["opt.pt_rdp0.smp_index.json", "opt.pt_rdp0_0"]
    assert ckpt.load(f, partial=True) == {"x": 1}
    assert ckpt.load(f, partial=True, back_compat=True) == {"x": 1}
    ckpt.save({"x": 2}, f, partial=True, v3=False)  # without sharding
    assert ckpt.load(f, partial=True) == {"x": 2}
    with pytest.raises(smp_fx.SMPCheckpointError, match="partial=True with v3=True"):
        ckpt.save({"x": 1}, f, partial=False, v3=True)


def test_single_process_partial_save_writes_rank_file_and_index(tmp_path: Path) -> None:
    f = str(tmp_path / "checkpoint.pt")
    obj = stage_obj(0, 1.0)
    ckpt.save(obj, f)  # partial=True is the default
    assert os.path.exists(f + "_0") and os.path.exists(f + ".smp_index.json")
    index = read_index(f)
    assert index is not None and index["num_files"] == 1
    assert index["files"][0]["entries"] == {"model_state_dict": ["layer0.weight"]}
    loaded = ckpt.load(f)
    assert torch.equal(loaded["model_state_dict"]["layer0.weight"], torch.ones(2, 2))
    assert not any(name.endswith((".prev", ".tmp")) for name in os.listdir(tmp_path))


def test_two_rank_partial_save_and_reshard_merge(tmp_path: Path) -> None:
    f = str(tmp_path / "ck.pt")
    assert save_two(f, 2.0) == [None, None]
    index = read_index(f)
    assert index is not None and index["pp_degree"] == 2
    assert [e["file"] for e in index["files"]] == ["ck.pt_0", "ck.pt_1"]
    # each rank's own file, as a same-layout load reads it
    own = ckpt.read_partial_file(f, index["files"][1], index["save_id"])
    assert list(own["model_state_dict"]) == ["layer1.weight", PARTIAL_KEY]
    # this process is a world of one: a different layout, so all files merge by name
    merged = ckpt.load(f)
    assert list(merged["model_state_dict"]) == ["layer0.weight", "layer1.weight", PARTIAL_KEY]
    assert merged["epoch"] == 2
    _, objs = ckpt.load_partial_set(f)
    full = ckpt.merge_partial_objects(objs, full=True)
    assert PARTIAL_KEY not in full["model_state_dict"]


def test_failed_write_on_one_rank_aborts_everywhere(tmp_path: Path) -> None:
    f = str(tmp_path / "ck.pt")
    save_two(f, 1.0)

    def fn(rank: int, gather: Callable[[Any], list[Any]]) -> None:
        info = RankInfo(mp_rank=rank, num_files=2, pp_degree=2, pp_rank=rank)
        obj: Any = stage_obj(rank, 7.0)
        if rank == 1:
            obj = {"bad": lambda: None}  # cannot be pickled
        save_partial(obj, f, info, gather)

    errors = run_thread_ranks(2, fn)
    assert all(isinstance(e, SMPCheckpointError) for e in errors)
    assert "mp_rank" in str(errors[0]) and "{1:" in str(errors[0])
    assert ckpt.load(f)["epoch"] == 1
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


def test_crash_between_renames_and_index_keeps_previous_loadable(tmp_path: Path) -> None:
    f = str(tmp_path / "ck.pt")
    save_two(f, 1.0)
    # rank 1 dies right after the "all written" gather (before its rename); rank 0 renames
    # and then dies waiting for rank 1: index and rank 1 are old, rank 0 is new.
    errors = save_two(f, 2.0, wrap={1: lambda g: crash_at(g, 2, after=True),
                                    0: lambda g: crash_at(g, 3, after=False)})
    assert all(isinstance(e, Crash) for e in errors)
    assert os.path.exists(f + "_0.prev")
    loaded = ckpt.load(f)
    assert loaded["epoch"] == 1
    assert torch.equal(loaded["model_state_dict"]["layer0.weight"], torch.ones(2, 2))
    # a second interrupted save must not overwrite the committed .prev
    save_two(f, 3.0, wrap={1: lambda g: crash_at(g, 2, after=True),
                           0: lambda g: crash_at(g, 3, after=False)})
    assert ckpt.load(f)["epoch"] == 1
    # then a clean save commits and cleans up
    assert save_two(f, 4.0) == [None, None]
    assert ckpt.load(f)["epoch"] == 4
    assert not any(n.endswith((".prev", ".tmp")) for n in os.listdir(tmp_path))


def test_damaged_set_is_an_error_not_a_guess(tmp_path: Path) -> None:
    f = str(tmp_path / "ck.pt")
    save_two(f, 1.0)
    ckpt.save({"x": 1}, f + "_1", partial=False)  # foreign file in the set
    with pytest.raises(SMPCheckpointError, match="save id"):
        ckpt.load(f)


SLOW_SAVE = textwrap.dedent("""
    import sys, time, torch
    from smp_fx.ckpt import files as ckpt

    class Slow:
        def __reduce__(self):
            time.sleep(60)
            return (int, (0,))

    f, partial = sys.argv[1], sys.argv[2] == "partial"
    ckpt.save({"w": torch.ones(3), "gen": 1}, f, partial=partial)
    open(f + ".first-done", "w").close()
    ckpt.save({"w": torch.zeros(3), "gen": 2, "slow": Slow()}, f, partial=partial)
""")


@pytest.mark.multiproc
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path: Path, partial: bool) -> None:
    f = str(tmp_path / "ck.pt")
    kill_mid_save(SLOW_SAVE, [f, "partial" if partial else "full"], lambda: os.path.exists(
        f + ".first-done") and any(n.endswith(".tmp") for n in os.listdir(tmp_path)),
        tmp_path, timeout=60)
    loaded = ckpt.load(f, partial=partial)
    assert loaded["gen"] == 1 and torch.equal(loaded["w"], torch.ones(3))
