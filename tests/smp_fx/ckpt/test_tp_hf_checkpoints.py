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
from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks

BATCH, STEPS, LR = 4, 4, 0.1
ARCHS = ("mixtral", "phi3", "t5")


def _batches(arch: str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    torch.manual_seed(7)
    return [(hf_zoo.inputs(arch, BATCH), hf_zoo.targets(arch, BATCH)) for _ in range(STEPS)]


class Run:
    """A DistributedModel of ``arch`` and its SGD at one tp degree (rdp = 4 / tp)."""

    def __init__(self, arch: str, tp: int, seed: int) -> None:
        import smp_fx as smp
        from smp_fx.world import state

        smp.reset()
        state._reset()  # a new degree: a new configuration and groups
        smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": tp, "ddp": True,
                  "prescaled_batch": True, "microbatches": 1})
        self.arch = arch
        self.model = smp.DistributedModel(hf_zoo.build(arch, seed=seed))
        self.opt = smp.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=LR))

        @smp.step
        def train_step(model: Any, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> Any:
            loss = hf_zoo.loss_fn(model(*x), y)
            model.backward(loss)
            return loss

        self.train_step = train_step

    def step(self, i: int) -> None:
        import smp_fx as smp

        x, y = _batches(self.arch)[i]
        share = BATCH // smp.rdp_size()
        sl = slice(smp.rdp_rank() * share, (smp.rdp_rank() + 1) * share)
        self.opt.zero_grad()
        self.train_step(self.model, tuple(t[sl] for t in x), y[sl])
        self.opt.step()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def _case(path: str, arch: str) -> list[str]:
    import smp_fx as smp

    run = Run(arch, 2, seed=0)
    run.step(0)
    run.step(1)
    smp.save_checkpoint(path, "tp2", model=run.model, optimizer=run.opt)
    smp.save_checkpoint(path, "full", partial=False, model=run.model)
    at_save = run.state()
    run.step(2)
    run.step(3)
    want = run.state()
    bad = []
    for tp in (1, 4):
        resumed = Run(arch, tp, seed=1)  # other weights: all must come from the checkpoint
        smp.resume_from_checkpoint(path, tag="tp2")
        resumed.step(2)
        resumed.step(3)
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
