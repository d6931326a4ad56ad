"""Compiled stages equal one process on Hugging Face ViT (``ViTForImageClassification``
from a tiny config, ``examples/models/hf_zoo.py``) with microbatches of one image: pp 2 on 2
gloo processes under 1F1B and ZB-V, compiled with ``aot_eager``, ``test_compiled``'s checks
(every step's loss and gradients, the ``state_dict()`` after 3 Adam steps, within 1e-5);
and at pp 1 x dp 2 under DDP, one image per microbatch, two SGD steps against one process.

One image per microbatch is the case where AOTAutograd hands ``cls_token``'s gradient as a
view of ``position_embeddings``'; without ``compiled.unalias_gradients`` the second
microbatch's ``cls_token`` gradient is counted twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.dist import run_ranks
from tests.smp_fx.runtime.executor.test_compiled import BATCH, _all_cases, _references

CASES = tuple(("vit", pipeline, v, "aot_eager") for pipeline, v in (("interleaved", 1),
                                                                    ("zbv", 2)))


@pytest.mark.multiproc
def test_compiled_vit_with_one_image_per_microbatch_equals_one_process(tmp_path: Path
                                                                      ) -> None:
    path = tmp_path / "references.pt"
    _references(path, CASES)
    assert run_ranks(_all_cases, 2, str(path), CASES, False, BATCH, timeout=600) == [[], []]


def _dp2_mismatches() -> list[str]:
    """ViT compiled at pp 1 x dp 2 (DDP), a batch of four: two images a rank, one per
    microbatch; two SGD steps against one process: the mismatched parameters."""
    import torch

    from tests.helpers import zoo

    _, want = zoo.sgd_reference("vit", BATCH, 2, 1.0)
    run = zoo.DistributedRun("vit", {"pipeline_parallel_degree": 1, "ddp": True,
                                     "microbatches": 2, "compile": "aot_eager"},
                             lambda ps: torch.optim.SGD(ps, lr=1.0))
    for batch in zoo.batches("vit", BATCH, 2):
        run.step(batch)
    got = run.state()
    bad = [k for k in want if not torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-5)]
    copied = sum(s.unaliased for s in run.model.parallelized.compiled.values())
    return bad + ([] if copied else ["no gradient copied: the aliasing case was not reached"])


@pytest.mark.multiproc
def test_compiled_vit_under_ddp_with_one_image_per_microbatch_equals_one_process() -> None:
    assert run_ranks(_dp2_mismatches, 2, timeout=300) == [[], []]
