"""A Hugging Face causal LM trained with ``labels=`` at tp=2 (2 gloo ranks), its loss fused.

The tiny HF GPT-2 (torch.export graph) with its tied ``lm_head`` and ``transformer.wte``
marked (``pair``), or the whole model marked (``whole``: attention by heads and the MLPs
too; before, the loss inside the region replicated all of it). transformers computes the
loss in the forward (``logits.float()``, labels shifted, ``cross_entropy(ignore_index=
-100)``; every third label is -100), which ``passes.tensor_parallel.loss`` fuses, so the logits are
never gathered: the spy sees the op run on 64 columns (vocabulary 128, or 127, odd like
GPT-2's 50257, padded to 128). 3 Adam steps equal one process: losses, full gradients,
``state_dict()``.

``prescaled_batch`` false: rank r feeds half r of the batch and its loss is the mean over
that half's labels not ignored, so the reference is the mean of the halves' losses (one
microbatch); true: both ranks the first half.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from tests.helpers.tp_loss_run import checked, run_each_at_tp2
from tests.passes.tensor_parallel.test_vocab import HFLoss, hf_labels
from tests.smp_fx.parallel.test_tensor_parallel import GLOBAL_BATCH, STEPS


def _build(marking: str, vocab: int) -> HFLoss:
    import smp_fx as smp

    torch.manual_seed(0)
    model = HFLoss(vocab=vocab)
    for module in ((model.model,) if marking == "whole" else
                   (model.model.transformer.wte, model.model.lm_head)):
        smp.set_tensor_parallelism(module)
    return model


def _batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, vocab, (GLOBAL_BATCH, 16), generator=g) for _ in range(STEPS)]
    return [(x, hf_labels(x)) for x in ids]


CASES = (("pair", 128, False), ("pair", 128, True), ("whole", 128, False),
         ("whole", 128, True), ("pair", 127, False), ("pair", 127, True))
"""(marking, vocabulary, prescaled_batch): every case runs in one spawn of 2 ranks."""
_RESULTS: dict[str, list[Any]] = {}


def _name(marking: str, vocab: int, prescaled: bool) -> str:
    return f"{marking} {vocab} prescaled={prescaled}"


@pytest.mark.multiproc
@pytest.mark.timeout(400)  # the first runs the spawn of every case
@pytest.mark.parametrize(("marking", "vocab", "prescaled"), CASES)
def test_hf_causal_lm_loss_with_labels_matches_single_process(marking: str, vocab: int,
                                                              prescaled: bool) -> None:
    if not _RESULTS:
        _RESULTS.update(run_each_at_tp2(
            {_name(*case): (functools.partial(_build, *case[:2]),
                            functools.partial(_batches, case[1]), case[2]) for case in CASES},
            timeout=350))
    name = _name(marking, vocab, prescaled)
    for res in checked(name, _RESULTS[name]):
        assert res["widths"] == [64]  # the fused loss ran, on this rank's 64 columns only
        assert res["sharded"] == (15 if marking == "whole" else 2)  # whole: wpe, 2 blocks too
