"""Straight-through ranks (the middle and the last) across 3 gloo processes. Hugging Face
GPT-2 (export-captured, so received shapes are checked) on varying sequence lengths equals
plain PyTorch in loss, gradients and parameters, every rank straight after the first
step (the first stage's with the step function's microbatch tensors, as learned);
a rank given a shorter sequence than the others names it at its model(...) call. A step
function that calls the model under another grad mode than its first step, or not at
all, fails that rank's step with the rule after its ops and this step's collectives (the
straggler watch's), so the other ranks finish theirs, and the next step works."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from cost_model.errors import SMPRuntimeError
from smp_fx.world import state
from tests.helpers.numerics import Pair, init
from tests.smp_fx.runtime.inputs.test_shapes import _batches


def _gpt2() -> list[Any]:
    """3 steps on sequence lengths 16, 12, 16 (compared), then one with rank 1's 12 and
    then one as usual: the largest difference, straight steps, each late step's result."""
    import torch.distributed as dist

    init(3, 2, "interleaved")
    torch.manual_seed(3)
    pair = Pair("hf_gpt2", model_kwargs={"n_positions": 32})
    batches = _batches(pair, ((4, 16), (4, 12), (4, 16)))
    pair.x, pair.y = batches[0]
    out: list[Any] = [pair.compare(3, 2, batches=batches)]
    out.append(pair.dm.executor.conductor.straight_steps)
    for short in (smp.pp_rank() == 1, False):
        (x,), y = batches[0]
        try:
            pair.train_step(pair.dm, x[:, :12] if short else x, y[:, :12] if short else y)
            out.append("ok")
        except SMPRuntimeError as exc:
            out.append(str(exc))
        dist.barrier()
    state._reset()
    return out


def _body() -> list[Any]:
    """Runs on every rank: ``_gpt2``; then steps 1, 3 and 5 as usual; in 2 every rank calls
    the model under torch.no_grad (rank 1's forwards ran with grad, as learned in step 1);
    in 4 rank 1 alone skips the model."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    gpt2 = _gpt2()
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
    return [gpt2, seen]


@pytest.mark.multiproc
def test_straight_ranks_train_as_torch_and_fail_alone_when_they_stray() -> None:
    from tests.helpers.dist import run_ranks

    (gpt0, first), (gpt1, middle), (gpt2, last) = run_ranks(_body, 3, timeout=240)
    assert all(g[0] <= 1e-5 for g in (gpt0, gpt1, gpt2))
    assert gpt0[1:] == gpt2[1:] == [2, "ok", "ok"], (gpt0, gpt2)
    assert gpt1[1] == 2 and gpt1[3] == "ok", gpt1
    assert "different shapes" in gpt1[2] and "input 'input_ids' dimension 1: 12 on this " \
        "rank, 16 on the sending rank" in gpt1[2], gpt1[2]
    assert middle[0] == middle[2] == middle[4] == "ok" and middle[5] == "straight 2"
    for seen in (first, last):
        assert seen[0] == seen[2] == seen[3] == seen[4] == "ok" and seen[5] == "straight 3"
    for rank, seen in ((0, first), (1, middle), (2, last)):
        assert "same torch.no_grad/autocast in every step" in seen[1]
        assert "grad enabled False" in seen[1] and f"rank {rank} microbatch 0" in seen[1]
    assert "returned without calling the DistributedModel" in middle[3]
