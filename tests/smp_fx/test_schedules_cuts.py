"""Any cut the partitioner may choose equals one process: seeded random cuts of Hugging Face
models across processes, under the split backward.

The partitioner's cut follows measured costs, so a run on another machine (or under other
load) cuts a model elsewhere, through the middle of a layer as readily as between layers.
Here each case replaces its solver with a seeded random cut into 4 chunks (any cut in
graph order is one the partitioner may return; ``passes.in_place.colocate`` then keeps
in-place writes together, as it does for the solver's), and trains the model at pp 2 under
ZB-V (I then W) across 2 gloo processes: every gradient after every step and the
``state_dict()`` after 3 Adam steps within 1e-5 of the plain model. Mistral, whose forward
makes a constant that export detaches in place, and T5, whose position bias (a parameter's
value alone) feeds later layers and its own layer's scores, failed on some such cuts.

A restarted job may cut the same model elsewhere too: a partial checkpoint saved on one
cut (a third of the graph's nodes on stage 0) resumes on another (two thirds) at the same
degrees (Adam's state of a parameter that moved
stage comes from the stage that saved it) and takes the next step as the uninterrupted run.

And a batch whose length changes every step (dynamic padding) trains at pp 2 x tp 2 on a
random cut as one process does on the same batches (Llama at odd lengths, Mistral under
sequence parallelism).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_ranks
from tests.smp_fx import test_schedules_hf as hf_grid

ARCHS = ("mistral", "t5", "bart", "swin")
RESUMED = ("t5", "llama")
CUTS = 2  # per model
SEED = 2026


def _random_cuts(seed: int) -> Any:
    """A solver returning a seeded random cut in graph order (every rank draws the same)."""
    rng = random.Random(seed)

    def solve(problem: Any, obj: Any) -> tuple[np.ndarray, str]:
        n = len(problem.names)
        stage = np.zeros(n, dtype=np.int64)
        for point in sorted(rng.sample(range(1, n), obj.num_stages - 1)):
            stage[point:] += 1
        return stage, "random"

    return solve


def _cases(path: str) -> list[str]:
    import passes.auto_partition as auto
    from smp_fx.world import state

    dist.init_process_group("gloo")
    refs = torch.load(path, weights_only=True)
    real = auto.solve_problem
    auto.solve_problem = _random_cuts(SEED)
    try:
        return [bad for arch in ARCHS for _ in range(CUTS)
                for bad in hf_grid._case(arch, "zbv", 2, refs[arch])]
    finally:
        auto.solve_problem = real
        state._reset()


@pytest.mark.multiproc
def test_random_cuts_equal_one_process_under_zbv(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_grid, "CASES", tuple((a, "zbv", 2) for a in ARCHS))
    path = tmp_path / "references.pt"
    hf_grid._references(path)
    assert run_ranks(_cases, 2, str(path), timeout=600) == [[], []]


def _cut_at(fraction: float) -> Any:
    """A solver cutting 2 stages at ``fraction`` of the graph's nodes."""

    def solve(problem: Any, obj: Any) -> tuple[np.ndarray, str]:
        stage = np.zeros(len(problem.names), dtype=np.int64)
        stage[int(len(problem.names) * fraction):] = 1
        return stage, "fixed"

    return solve


def _resumed(path: str) -> list[str]:
    import passes.auto_partition as auto
    import smp_fx as smp
    from tests.helpers.compare import mismatched
    from tests.helpers.zoo import DistributedRun, batches

    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-3)

    dist.init_process_group("gloo")
    bad = []
    pp2 = {"pipeline_parallel_degree": 2}
    for arch in RESUMED:
        data = batches(arch, 4, 3)
        auto.solve_problem = _cut_at(1 / 3)
        run = DistributedRun(arch, pp2, adam)
        run.step(data[0])
        run.step(data[1])
        smp.save_checkpoint(f"{path}/{arch}", "s", model=run.model, optimizer=run.opt)
        run.step(data[2])
        want = run.state()
        auto.solve_problem = _cut_at(2 / 3)
        other = DistributedRun(arch, pp2, adam, seed=1)  # other weights, another cut
        smp.resume_from_checkpoint(f"{path}/{arch}", "s")
        other.step(data[2])
        if other.held() == run.held():
            bad.append(f"{arch}: both cuts put the same parameters on this rank")
        bad += [f"{arch} resumed on another cut: {n}" for n in
                mismatched(other.state(), want, atol=1e-6, rtol=1e-6)]
    return bad


@pytest.mark.multiproc
def test_a_checkpoint_resumes_on_another_random_cut(tmp_path: Path) -> None:
    assert run_ranks(_resumed, 2, str(tmp_path), timeout=600) == [[], []]


VARYING = (("llama", "speed", (16, 11, 7)), ("mistral", "memory", (16, 10, 6)))
"""A dynamically padded batch changes length every step: odd lengths at ``optimize:
speed``, multiples of tp under sequence parallelism (``memory``)."""


def _varying(refs_path: str) -> list[str]:
    import passes.auto_partition as auto
    from tests.helpers.compare import mismatched
    from tests.helpers.zoo import DistributedRun, batches

    dist.init_process_group("gloo")
    refs = torch.load(refs_path, weights_only=True)
    auto.solve_problem = _random_cuts(SEED)
    bad = []
    for arch, optimize, lengths in VARYING:
        run = DistributedRun(arch, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                                    "prescaled_batch": True, "optimize": optimize}, _adam)
        for batch in batches(arch, 4, len(lengths), lengths):
            run.step(batch)
        bad += [f"{arch} ({optimize}): {n}" for n in
                mismatched(run.state(), refs[arch], atol=1e-5, rtol=1e-4)]
    return bad


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


@pytest.mark.multiproc
def test_lengths_changing_every_step_on_a_random_cut_at_tp_2(tmp_path: Path) -> None:
    """pp 2 x tp 2 across 4 processes, each step another length, against one process."""
    from tests.helpers.zoo import reference

    path = tmp_path / "references.pt"
    torch.save({arch: reference(arch, 4, len(lengths), _adam, lengths=lengths)[1]
                for arch, _, lengths in VARYING}, path)
    assert run_ranks(_varying, 4, str(path), timeout=600) == [[]] * 4
