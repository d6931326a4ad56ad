"""A peer killed mid-step (SIGKILL) is named at once: SMPPeerError with its rank and stage and
what this rank was doing, well before any timeout."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.dist import run_ranks


def _killed_peer_body() -> Any:
    import os
    import signal
    import time

    import torch
    from torch import nn

    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))

    @smp.step
    def train(model: Any, x: torch.Tensor, k: int) -> Any:
        out = model(x)
        model.backward(out.sum())
        if k == 1 and smp.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    train(model, torch.randn(4, 4), 0)
    t = time.monotonic()
    try:
        train(model, torch.randn(4, 4), 1)
    except smp.SMPPeerError as exc:
        return str(exc), exc.peer_rank, time.monotonic() - t
    return "no error"


@pytest.mark.multiproc
def test_a_killed_peer_is_named_with_what_this_rank_was_doing() -> None:
    got, _ = run_ranks(_killed_peer_body, 2, timeout=60, may_die=(1,))
    text, peer, seconds = got
    assert peer == 1 and seconds < 30, got  # no timeout ran out
    assert text.startswith("lost the connection to stage 1 (rank 1): its process died"), text
    assert "at rank 0 (stage 0) in step 1, while " in text and "microbatch" in text, text
    assert "rank 1 failed first" in text
