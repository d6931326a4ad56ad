"""SMP's ``fp16`` through the Hugging Face Trainer (``examples/hf_trainer.py``, as
``test_hf_trainer.py`` runs it, beside the plain fp32 Trainer): at pp=2 with the script's
whole flow, and at tp=2 with ``ddp``, the configuration of AWS's GPT-2 Trainer notebook.
Apart from ``test_hf_trainer.py`` so the two files run side by side (``make test`` and
``make test-transformers4`` both run it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.examples.test_hf_trainer import SMP_ENV, _plain_sums_accumulation, _run_pair


@pytest.mark.multiproc
def test_trainer_smp_fp16_trains_as_the_plain_trainer_at_fp16_resolution(
        tmp_path: Path) -> None:
    """``fp16`` in SM_HP_MP_PARAMETERS (the Trainer takes its own ``fp16`` from it and
    unwraps SMP's fp16 optimizer for its scheduler): at pp=2 the model runs in half, its
    losses are the plain fp32 Trainer's within fp16's resolution, and a resumed run repeats
    the uninterrupted one."""
    env = {**SMP_ENV, "SM_HP_MP_PARAMETERS": json.dumps(
        {"partitions": 2, "microbatches": 2, "fp16": True})}
    plain_args = ["--average-accumulation"] if _plain_sums_accumulation() else []
    plain, smp_ranks = _run_pair(tmp_path, 2, env, [], plain_args)
    assert smp_ranks[0]["gas1"] == smp_ranks[1]["gas1"]
    got = smp_ranks[0]
    assert (got["param_dtypes"], plain["param_dtypes"]) == (["torch.float16"], ["torch.float32"])
    for run in ("gas1", "gas2"):  # 5e-5 relative seen (transformers 5.x)
        torch.testing.assert_close(torch.tensor(got[run]), torch.tensor(plain[run]),
                                   rtol=1e-3, atol=0, msg=lambda m, r=run: f"{r}: {m}")
    assert got["resumed"][2:] == got["gas1"][2:]


@pytest.mark.multiproc
def test_trainer_tp2_fp16_as_aws_gpt2_notebook_sets_it(tmp_path: Path) -> None:
    """tp=2 with ``ddp`` and ``fp16``, the configuration of AWS's GPT-2 Trainer notebook, per
    device batch 4 with SGD against the plain fp32 Trainer at batch 8: losses and evaluation
    loss within 1e-3, both tp ranks alike. Seen: 5e-6 under transformers 5.x, 4.8e-4 under
    4.46, whose GPT-2 takes its cross-entropy of the half logits (2.6e-4 at the first step,
    the weights still equal) where 5.x upcasts them."""
    env = {**SMP_ENV, "SM_HP_MP_PARAMETERS": json.dumps(
        {"partitions": 1, "tensor_parallel_degree": 2, "ddp": True, "fp16": True})}
    args = ["--train-only", "--optim", "sgd", "--set-tensor-parallelism"]
    plain, ranks = _run_pair(tmp_path, 2, env, [*args, "--batch", "4"], [*args, "--batch", "8"])
    assert ranks[0]["sgd"]["losses"] == ranks[1]["sgd"]["losses"]
    got, want = ranks[0]["sgd"], plain["sgd"]
    assert len(got["losses"]) == len(want["losses"]) == 4
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=1e-3, atol=0)
    assert abs(got["eval"] / want["eval"] - 1) < 1e-3
