"""A straight-through middle rank across 3 gloo processes: a step function that calls the
model under another grad mode than its first step, or not at all, fails that rank's step
with the rule after its ops and this step's collectives (the straggler watch's), so the
other ranks finish theirs, and the next step works."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from cost_model.errors import SMPRuntimeError
from tests.helpers.numerics import init


def _body() -> list[str]:
    """Runs on every rank: steps 1, 3 and 5 as usual; in 2 every rank calls the model under
    torch.no_grad (rank 1's forwards ran with grad, as learned in step 1); in 4 rank 1
    alone skips the model."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    init(3, 2, "interleaved")
    torch.manual_seed(0)
    model = smp.DistributedModel(nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]))

    @smp.step
    def train(model: Any, x: torch.Tensor, how: str) -> Any:
        if how == "skip" and smp.pp_rank() == 1:
            return None
        if how == "no_grad":
            with torch.no_grad():
                return model(x).sum()
        out = model(x).sum()
        model.backward(out)
        return out

    seen = []
    for how in ("train", "no_grad", "train", "skip", "train"):
        try:
            train(model, torch.ones(4, 4), how)
            seen.append("ok")
        except SMPRuntimeError as exc:
            seen.append(str(exc))
        dist.barrier()
    seen.append(f"straight {model.executor.conductor.straight_steps}")
    return seen


@pytest.mark.multiproc
def test_a_middle_rank_step_function_that_strays_fails_alone_and_bounded() -> None:
    from tests.helpers.dist import run_ranks

    first, middle, last = run_ranks(_body, 3, timeout=120)
    assert first == last == ["ok"] * 5 + ["straight 0"]
    assert middle[0] == middle[2] == middle[4] == "ok" and middle[5] == "straight 2"
    assert "same torch.no_grad/autocast in every step" in middle[1]
    assert "grad enabled False" in middle[1] and "rank 1 microbatch 0" in middle[1]
    assert "returned without calling the DistributedModel" in middle[3]
