"""On real ranks, a checkpoint that is bad on one rank fails on every rank at once: neither
smp.load nor load_state_dict leaves the healthy rank waiting in the next collective."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.dist import run_ranks


def _body(prefix: str) -> Any:
    import time

    import torch
    from torch import nn

    import smp_fx as smp
    from tests.helpers.compare import Checks

    ok = Checks()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))

    @smp.step
    def train(model: Any, x: torch.Tensor) -> Any:
        out = model(x)
        model.backward(out.sum())
        return out

    train(model, torch.randn(4, 4))
    smp.save({"model": model.local_state_dict()}, prefix, partial=True)
    smp.barrier()
    if smp.rank() == 1:  # this rank's file is cut short
        data = open(f"{prefix}_1", "rb").read()
        open(f"{prefix}_1", "wb").write(data[: len(data) // 2])
    smp.barrier()
    t = time.monotonic()
    try:
        smp.load(prefix)
        ok.expect(False, "truncated file: raised")
    except smp.SMPCheckpointError as exc:
        text = str(exc)
        ok.expect("failed on 1 of 2 rank(s)" in text and "rank 1: the checkpoint file is "
                  "truncated" in text and f"{prefix}_1" in text, f"names rank 1's file: {text}")
    # a state dict of another model: only rank 1's parameters are missing from it
    other = {k: v for k, v in model.local_state_dict().items() if smp.rank() == 0}
    other["_smp_is_partial"] = True
    try:
        model.load_state_dict(other)
        ok.expect(False, "another model's state: raised")
    except smp.SMPCheckpointError as exc:
        ok.expect("DistributedModel.load_state_dict failed on 1 of 2 rank(s)" in str(exc)
                  and "state dict does not match the model" in str(exc), str(exc))
    ok.expect(time.monotonic() - t < 20, "no rank waited for a timeout")
    train(model, torch.randn(4, 4))  # both ranks are still in step
    return ok.report()


@pytest.mark.multiproc
def test_a_bad_checkpoint_fails_every_rank_without_a_hang(tmp_path: Any) -> None:
    got = run_ranks(_body, 2, str(tmp_path / "ck.pt"), timeout=60)
    for count, failed in got:
        assert failed == [] and count == 3
