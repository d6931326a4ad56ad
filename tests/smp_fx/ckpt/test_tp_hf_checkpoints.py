"""Checkpoints of Hugging Face models sharded by tensor parallelism, across degrees.

One spawn of 4 gloo ranks runs each case (``smp.reset`` between the runs), SGD on a global
batch of 4 (each data-parallel rank its slice):

* at tp=2 (x rdp=2): 2 steps, ``smp.save_checkpoint`` (partial: each rank's shards with
  their descriptions; and full), 2 more steps: the uninterrupted run;
* a fresh model (other weights) at tp=1 (x rdp=4) resumes from the partial checkpoint and
  takes the same 2 steps: the uninterrupted run's ``state_dict()``; the same at tp=4;
* the full checkpoint loads into the plain model with ``strict=True``, equal to the
  weights at the save.

Cases: Mixtral (3-D expert weights split along their outputs, gate/up strided), Phi-3
(``qkv_proj`` and ``gate_up_proj`` strided), T5 (relative position bias table split by
buckets, encoder-decoder, the shared embedding by rows).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from examples.models import hf_zoo
from tests.helpers import zoo
from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.zoo import DistributedRun

BATCH, STEPS, LR = 4, 4, 0.1
ARCHS = ("mixtral", "phi3", "t5")


def _run(arch: str, tp: int, seed: int) -> DistributedRun:
    """A DistributedModel of ``arch`` and its SGD at one tp degree (rdp = 4 / tp)."""
    return DistributedRun(arch, {"pipeline_parallel_degree": 1, "tensor_parallel_degree": tp,
                                 "prescaled_batch": True},
                          lambda ps: torch.optim.SGD(ps, lr=LR), seed=seed)


def _case(path: str, arch: str) -> list[str]:
    import smp_fx as smp

    data = zoo.batches(arch, BATCH, STEPS)
    run = _run(arch, 2, seed=0)
    run.step(data[0])
    run.step(data[1])
    smp.save_checkpoint(path, "tp2", model=run.model, optimizer=run.opt)
    smp.save_checkpoint(path, "full", partial=False, model=run.model)
    at_save = run.state()
    run.step(data[2])
    run.step(data[3])
    want = run.state()
    bad = []
    for tp in (1, 4):
        resumed = _run(arch, tp, seed=1)  # other weights: all must come from the checkpoint
        smp.resume_from_checkpoint(path, tag="tp2")
        resumed.step(data[2])
        resumed.step(data[3])
        bad += [f"{arch} tp2->tp{tp} {n}"
                for n in mismatched(resumed.state(), want, atol=1e-5, rtol=1e-5)]
    if dist.get_rank() == 0:
        plain = hf_zoo.build(arch, marked=False, seed=1)
        plain.load_state_dict(torch.load(os.path.join(path, "full"), weights_only=True),
                              strict=True)
        bad += [f"{arch} full {n}" for n in mismatched(plain.state_dict(), at_save, atol=0,
                                                         rtol=0)]
    return bad


def _body(tmp: str) -> list[str]:
    dist.init_process_group("gloo")  # one default group; each run's smp.init adds its own
    return [b for arch in ARCHS for b in _case(os.path.join(tmp, arch), arch)]


@pytest.mark.multiproc
def test_hf_checkpoints_reshard_from_tp2_to_tp1_and_tp4(tmp_path: Any) -> None:
    results = run_ranks(_body, 4, str(tmp_path), timeout=600,
                        env={"SMP_FX_DEVICE_SPEC": "a100"})
    assert results == [[]] * 4, results
