"""The core guarantee: smp-fx reproduces the unpartitioned model's loss and gradients.

Every test trains the same model with smp-fx and as plain PyTorch and compares the loss,
every local parameter's gradient after each step, and the parameters and buffers after
3 optimizer steps (fp32, atol 1e-5). The reference is the unpartitioned model in one
process running the same microbatches one after another (loss / m backward each), which
is what SMP's pipeline computes; for models without batch statistics it equals the
full-batch gradient (``tests/helpers/numerics.py`` holds the comparison).

The grid covers fx-traced models (an MLP, a CNN with batch statistics, a GPT with a tied
embedding / LM head) and export-captured Hugging Face ones: GPT-2, and BERT, whose word
embedding is tied to the MLM decoder on the last stage and whose ``position_ids`` /
``token_type_ids`` are non-persistent buffers (absent from ``state_dict``, so buffers are
compared by ``named_buffers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.numerics import Pair, init

MODELS = ("mlp", "cnn", "gpt", "hf_gpt2", "hf_bert")
SCHEDULES = ("simple", "interleaved")
MICROBATCHES = (1, 2, 4, 8)
# Each microbatch count costs BERT an export trace (~2 s on a quiet machine). What BERT adds
# to the grid (a tied decoder on the last stage, non-persistent buffers) does not depend on
# the count; these two are the ends: fewer microbatches than stages at pp 4, and one sample
# per microbatch (the longest schedules).
MICROBATCHES_OF = {"hf_bert": (2, 8)}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_in_process_grid(name: str, pp: int) -> None:
    """Every microbatch count (BERT: its two) and schedule. The model is partitioned once
    per microbatch count (the export front end specialises shapes to the traced
    microbatch)."""
    for m in MICROBATCHES_OF.get(name, MICROBATCHES):
        init(pp, m, "simple")
        pair = Pair(name)
        for pipeline in SCHEDULES:
            init(pp, m, pipeline)
            pair.compare(3, m)
        assert pair.dm.partitioned and len(pair.dm.program.stages) == pp


def _eval_matches(pair: Pair) -> str:
    """An evaluation step (no backward, under no_grad: forward-only schedule) on every rank
    returns the reference model's outputs."""
    import smp_fx as smp

    pair.dm.eval()
    pair.ref.eval()

    @smp.step
    def evaluate(model: Any, x: torch.Tensor) -> Any:
        return model(x)

    with torch.no_grad():
        out = evaluate(pair.dm, pair.x[0]).concat()
        torch.testing.assert_close(out, pair.ref(pair.x[0]), atol=1e-5, rtol=0)
    pair.dm.train()
    pair.ref.train()
    return "eval"


def _multi_body(pp: int) -> list[str]:
    """Runs on every rank: both schedules, mb 4, two models, one world (joined already)."""
    done = []
    for name in ("cnn", "gpt"):
        init(pp, 4, "simple")
        pair = Pair(name)
        for pipeline in SCHEDULES:
            init(pp, 4, pipeline)
            pair.compare(3, 4)
            done.append(f"{name}/{pipeline}")
        assert len(list(pair.dm.local_parameters())) < len(list(pair.ref.parameters()))
        done.append(_eval_matches(pair))
    return done


def _on_world(*bodies: tuple[Callable[..., list[str]], tuple[Any, ...]]) -> list[list[str]]:
    """Each ``(body, args)`` in turn on one gloo world, joined once."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return [body(*args) for body, args in bodies]


_FOUR: list[list[list[str]]] = []


def _four_ranks() -> list[list[list[str]]]:
    """Each rank's results of ``_multi_body(4)`` and ``_checkpointing_body()``: one spawn of
    4 ranks for both tests."""
    if not _FOUR:
        _FOUR.extend(run_ranks(_on_world, 4, (_multi_body, (4,)), (_checkpointing_body, ()),
                               timeout=400))
    return _FOUR


@pytest.mark.multiproc
@pytest.mark.timeout(450)
@pytest.mark.parametrize("pp", [2, 4])
def test_multi_process_gloo(pp: int) -> None:
    results = ([r[0] for r in _four_ranks()] if pp == 4 else
               [r[0] for r in run_ranks(_on_world, 2, (_multi_body, (2,)), timeout=240)])
    assert all(r == ["cnn/simple", "cnn/interleaved", "eval", "gpt/simple", "gpt/interleaved",
                     "eval"] for r in results)


# ---- activation checkpointing and offloading ---------------------------------------------
@pytest.mark.parametrize("strategy, offload", [("each", False), ("contiguous", False),
                                               ("group_2", False), ("each", True)])
def test_checkpointing_is_bitwise_the_plain_pipeline(strategy: str, offload: bool) -> None:
    """pp 2 in one process, dropout on: checkpointed (and offloaded) training gives the very
    losses and parameters of the plain pipeline, since recomputation replays the RNG."""
    from tests.helpers.memory import train

    plain = train(None)
    run = train(strategy, offload=offload)
    assert run.plan.stages[0].checkpointed and run.plan.stages[1].checkpointed
    assert run.losses == plain.losses
    assert [n for n, p in run.params.items() if not torch.equal(p, plain.params[n])] == []


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2"])
def test_checkpointed_transformers_match_the_unpartitioned_model(name: str) -> None:
    """Every transformer block but the last checkpointed, and the last one's attention core
    (``recompute_granularity: selective``: an sdpa node, or Hugging Face's eager chain
    from matmul to matmul), on fx-traced and export-captured aten graphs: the grid's
    comparison (loss, gradients, parameters against the plain single-process model)
    still holds."""
    import re

    import smp_fx as smp

    init(2, 2, "interleaved", recompute_granularity="selective")
    pair = Pair(name)
    named = [(n, m) for n, m in pair.dm.module.named_modules()
             if re.fullmatch(r"(model\.transformer\.)?h\.\d+", n)]
    for _, block in named[:-1]:
        smp.set_activation_checkpointing(block)
    pair.compare(2, 2)
    assert sorted(r for st in pair.dm.plan.stages for r in st.checkpointed) == sorted(
        [n for n, _ in named[:-1]] + [f"{named[-1][0]}.attn.attention_core"])
    assert len(named) >= 2


def _checkpointing_body() -> list[str]:
    """pp 2 x dp 2: plain, then checkpointed and offloaded, in one world; the same losses
    and parameters (bitwise) on every rank."""
    import torch.distributed as dist

    from tests.helpers.memory import train

    plain = train(None, ddp=True, seed=dist.get_rank() // 2)
    run = train("group_2", offload=True, ddp=True, seed=dist.get_rank() // 2)
    bad = [n for n, p in run.params.items() if not torch.equal(p, plain.params[n])]
    if run.losses != plain.losses:
        bad.append(f"losses {run.losses} != {plain.losses}")
    if not all(st.checkpointed for st in run.plan.stages):
        bad.append("a stage without regions")
    return bad


@pytest.mark.multiproc
@pytest.mark.timeout(450)
def test_checkpointing_across_processes_with_data_parallelism() -> None:
    for _, bad in _four_ranks():
        assert bad == [], bad
