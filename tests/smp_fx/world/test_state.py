"""The state's reset (``smp_fx.world.state._reset``, what a process that calls ``smp.init``
again starts from) on real gloo ranks destroys every process group smp-fx made for that
state: ``smp.init``'s axis groups and the ones made after it (the pipeline's channels, tied
weights' groups), so such a process does not pile up gloo's connection threads; the world
group the script made stays."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import smp_fx as smp
from smp_fx.world import state
from tests.helpers.dist import run_ranks


def _gloo_loops() -> int:
    """Gloo's connection threads in this process (one per live group this rank is in)."""
    return sum(1 for t in Path("/proc/self/task").iterdir()
               if (t / "comm").read_text().strip() == "gloo_tcp_loop")


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(x)))


def _one_init() -> dict[str, int]:
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "pipeline": "interleaved",
              "virtual_pipeline_degree": 2})
    model = smp.DistributedModel(_Tied())

    @smp.step
    def step(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        model.backward(loss)
        return loss

    step(model, torch.arange(8).view(2, 4) % 8)
    owned = len(state.get().owned)
    loops = _gloo_loops()
    del model, step
    state._reset()
    gc.collect()
    return {"owned": owned, "loops": loops, "after": _gloo_loops()}


def _body() -> dict[str, object]:
    dist.init_process_group("gloo")
    base = _gloo_loops()
    runs = [_one_init() for _ in range(3)]
    alive = dist.is_initialized() and dist.get_world_size() == 2
    return {"base": base, "runs": runs, "alive": alive}


@pytest.mark.multiproc
def test_reset_destroys_the_groups_made_after_init_and_keeps_the_world() -> None:
    for rank, r in enumerate(run_ranks(_body, 2)):
        assert r["alive"], rank
        for run in r["runs"]:  # type: ignore[attr-defined]
            # interleaved v = 2: 3 channels x 2 x 2 lanes, and the tied embedding's group
            assert run["owned"] >= 13, (rank, run)
            assert run["loops"] > r["base"] + 13, (rank, run)
            assert run["after"] == r["base"], (rank, run, r["base"])
