"""The vocab-parallel cross entropy (``passes.tensor_parallel.loss``) end to end on 2 gloo ranks
(tp=2).

The GPT-2-style example with a vocabulary of 63 (wte / lm_head padded to 64 rows, 32 per
rank; every block marked whole) computes its loss in the forward, ``F.cross_entropy`` of
the tied head's logits with ``ignore_index=0`` (some targets are ignored). The graph fuses
the loss (the logits are never gathered: the spy below sees the op run on 32 columns), and
3 Adam steps equal one process: losses, full gradients, parameters and ``state_dict()``.

``prescaled_batch`` false: rank r feeds half r of the batch and its loss is that half's
mean, so the reference is the mean of the halves' losses (with ignored tokens the halves
count different tokens; one microbatch, as a microbatch's loss is its own mean); true:
both ranks the first half.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tp_loss_run import run_at_tp2
from tests.passes.tensor_parallel.test_vocab import LossInside
from tests.smp_fx.parallel.test_tensor_parallel import GLOBAL_BATCH, STEPS

VOCAB = 63


def _build() -> LossInside:
    import smp_fx as smp

    torch.manual_seed(0)
    model = LossInside(VOCAB)
    for module in (model.gpt.wte, model.gpt.lm_head, *model.gpt.h):
        smp.set_tensor_parallelism(module)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, 16), generator=g),
             torch.randint(0, VOCAB // 4, (GLOBAL_BATCH, 16), generator=g))  # 0s: ignored
            for _ in range(STEPS)]


@pytest.mark.multiproc
@pytest.mark.parametrize("prescaled", [False, True])
def test_fused_vocab_parallel_loss_matches_single_process(prescaled: bool) -> None:
    for res in run_at_tp2(_build, _batches, prescaled):
        assert res["widths"] == [32]  # the fused loss ran, on this rank's 32 columns only
