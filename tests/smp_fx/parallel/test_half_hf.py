"""fp16 (SMP's ``fp16``: half parameters, fp32 masters, loss scaling) on Hugging Face models
across 2 gloo ranks: tensor parallelism (tp 2) and the pipeline (pp 2, 1F1B) each against
data parallelism (dp 2) in the same world, 3 SGD steps on the same global batch.

Llama is captured by ``torch.export``; BART in fp16 cannot be (its layers clamp their
activations when one is not finite, a branch on values), so it takes the fx path with its
layers as leaves. Each case's losses (averaged over the data-parallel ranks) and its
``state_dict()`` after the steps must match dp 2's within fp16's rounding (the runs sum in
other orders), with the same overflow decisions, half parameters, and parameters that
moved. One spawn runs every case.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers import zoo
from tests.helpers.compare import mismatched, state_dict_mismatches
from tests.helpers.dist import run_ranks

GLOBAL_BATCH, STEPS, LR = 2, 3, 0.1
TOL = {"atol": 5e-4, "rtol": 1e-3}  # the largest seen: 6.1e-5
LOSS_RTOL = 1e-4  # the largest seen: 5.5e-6
ARCHS = ("llama", "bart")
DP = {"pipeline_parallel_degree": 1}
LAYOUTS = {"tp 2": {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2},
           "pp 2": {"pipeline_parallel_degree": 2, "microbatches": 2}}


def _train(arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """``arch`` in fp16 under ``config``: mean losses, overflows, final and first state."""
    import smp_fx as smp

    run = zoo.DistributedRun(arch, {"fp16": True, **config},
                             functools.partial(torch.optim.SGD, lr=LR))
    first = {k: v.float() for k, v in run.state().items()}
    losses, overflows = [], []
    for batch in zoo.batches(arch, GLOBAL_BATCH, STEPS):
        loss = torch.tensor([float(run.step(batch).reduce_mean())])
        dist.all_reduce(loss, group=smp.get_rdp_process_group())
        losses.append(float(loss) / smp.rdp_size())
        overflows.append(bool(run.opt.overflow))
    half = all(p.dtype == torch.float16 for _, p in run.model.local_named_parameters())
    return {"losses": losses, "overflows": overflows, "half": half, "first": first,
            "state": {k: v.float() for k, v in run.state().items()}}


def _all_cases() -> list[str]:
    from smp_fx.world import state

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    bad: list[str] = []
    try:
        for arch in ARCHS:
            ref = _train(arch, DP)
            moved = mismatched(ref["state"], ref["first"])
            if len(moved) < len(ref["state"]) // 2:
                bad.append(f"{arch} dp 2: only {len(moved)} of {len(ref['state'])} moved")
            for name, config in LAYOUTS.items():
                got = _train(arch, config)
                tag = f"{arch} {name}"
                bad += [f"{tag}: loss step {i} {g} vs {r}" for i, (g, r) in
                        enumerate(zip(got["losses"], ref["losses"], strict=True))
                        if abs(g - r) > LOSS_RTOL * abs(r)]
                bad += [f"{tag}: overflows {got['overflows']} vs {ref['overflows']}"
                        ] if got["overflows"] != ref["overflows"] else []
                bad += [] if got["half"] else [f"{tag}: parameters not fp16"]
                bad += [f"{tag}: {b}"
                        for b in state_dict_mismatches(got["state"], ref["state"], **TOL)]
    finally:
        state._reset()
    return bad


@pytest.mark.multiproc
def test_fp16_hugging_face_models_match_data_parallelism_across_processes() -> None:
    assert run_ranks(_all_cases, 2, timeout=300) == [[], []]
