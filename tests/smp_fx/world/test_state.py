"""Process groups across ``smp.init`` calls on real gloo ranks: the pipeline's channel
groups are made once per process and shared by every model (``state.shared_group``), so a
process that calls ``smp.init`` again (after the state's reset, as tests do) does not pile
up gloo's connection threads, and a model built before a reset still trains after it; the
groups of the state (``smp.init``'s, ``state.new_group``'s) go with it. After a step that
failed midway (its peer timed out: gloo closed the connection), the next model gets new
groups on every rank and trains as the plain model."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import smp_fx as smp
from smp_fx.world import state
from tests.helpers.dist import run_ranks
from tests.helpers.numerics import init


def _gloo_loops() -> int:
    """Gloo's connection threads in this process (one per live group this rank is in),
    once garbage is collected and the count holds for 50 ms (a destroyed group's thread
    ends when its last reference goes)."""
    gc.collect()
    seen = -1
    for _ in range(40):
        names = []
        for t in Path("/proc/self/task").iterdir():
            try:
                names.append((t / "comm").read_text().strip())
            except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
                continue
        count = names.count("gloo_tcp_loop")
        if count == seen:
            break
        seen = count
        time.sleep(0.05)
    return seen


def _init() -> None:
    init(2, 2, "interleaved", virtual_pipeline_degree=2)  # resets the state first


@smp.step
def _step(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).sum()
    model.backward(loss)
    return loss


def _layers(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])


def _model() -> smp.DistributedModel:
    return smp.DistributedModel(_layers(0))


def _body() -> dict[str, object]:
    dist.init_process_group("gloo")
    base = _gloo_loops()
    after = []
    for _ in range(3):
        _init()
        _step(_model(), torch.ones(2, 4))
        lone = state.new_group([0, 1])  # the state's own: gone with its reset
        after.append(_gloo_loops())
    kept = _model()
    _step(kept, torch.ones(2, 4))
    _init()  # a model built before a reset trains after it
    loss = float(_step(kept, torch.ones(2, 4)).reduce_mean())
    state._reset()
    lone_gone = lone not in dist.distributed_c10d._world.pg_map
    del kept, lone  # a destroyed group's thread lives while the group object does
    return {"base": base, "after": after, "end": _gloo_loops(), "loss": loss,
            "lone_gone": lone_gone}


@pytest.mark.multiproc
def test_channel_groups_are_made_once_and_a_models_groups_outlive_a_reset() -> None:
    for rank, r in enumerate(run_ranks(_body, 2)):
        # interleaved v = 2: 3 channels x 2 x 2 lanes, made by the first init only
        assert r["after"][0] >= r["base"] + 12 + 1, (rank, r)  # type: ignore[operator]
        assert r["after"] == [r["after"][0]] * 3, (rank, r)  # type: ignore[index]
        assert r["end"] == r["base"] + 12, (rank, r)  # type: ignore[operator]
        assert r["lone_gone"] and r["loss"] == r["loss"], (rank, r)


_CALLS = [0]


@smp.step
def _failing_step(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
    _CALLS[0] += 1
    out = model(x)
    if smp.rank() == 1 and _CALLS[0] == 2:  # rank 1, the second microbatch's step function
        raise ValueError("deliberate")
    loss = out.sum()
    model.backward(loss)
    return loss


def _after_failure() -> dict[str, object]:
    dist.init_process_group("gloo")
    init(2, 4, "interleaved")
    x = torch.arange(32.0).reshape(8, 4) / 10
    failed = ""
    try:
        _failing_step(smp.DistributedModel(_layers(0)), x)
    except Exception as exc:  # rank 1: the step function's error; rank 0: its peer's silence
        failed = type(exc).__name__
    spoilt = dict(state._SHARED)
    model = smp.DistributedModel(_layers(1))
    loss = _step(model, x)
    with torch.no_grad():
        want = float(_layers(1)(x).sum())
    renewed = not any(g is spoilt.get(k) for k, g in state._SHARED.items())
    return {"failed": failed, "loss": float(loss.reduce_mean()) * 4, "want": want,
            "renewed": renewed, "groups": len(state._SHARED)}


@pytest.mark.multiproc
def test_after_a_failed_step_the_next_model_gets_new_groups_and_trains() -> None:
    results = run_ranks(_after_failure, 2, timeout=90, env={"SMP_FX_TIMEOUT_S": "6"})
    assert results[1]["failed"] == "ValueError", results
    assert results[0]["failed"] == "SMPTimeoutError", results
    for rank, r in enumerate(results):
        assert r["renewed"] and r["groups"] == 3, (rank, r)  # 3 channels, one lane
        torch.testing.assert_close(r["loss"], r["want"], rtol=1e-5, atol=1e-5)
