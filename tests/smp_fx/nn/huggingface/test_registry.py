"""SMP's Hugging Face replacements in the orders SMP's documentation and AWS's scripts use:
an optimizer made on the original's parameters before ``smp.DistributedModel`` trains the
replacement (GPT-2, BERT, RoBERTa at tp 2 on 2 processes, equal to one process, every
parameter moved by every step), and ``return_dict=False`` gives Hugging Face's tuple."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from tests.helpers.dist import run_ranks
from tests.helpers.numerics import init

transformers = pytest.importorskip("transformers")

FAMILIES = ("gpt2", "bert", "roberta")


def _build(family: str) -> nn.Module:
    """A tiny model of ``family`` with its language-model head, no dropout, seed 0."""
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0))
    config_cls, model_cls = {"bert": ("BertConfig", "BertForMaskedLM"),
                             "roberta": ("RobertaConfig", "RobertaForMaskedLM")}[family]
    config = getattr(transformers, config_cls)(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=24, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1)
    return getattr(transformers, model_cls)(config)


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids)["loss"]


def _ids() -> torch.Tensor:
    return torch.randint(3, 64, (4, 12), generator=torch.Generator().manual_seed(5))


@smp.step
def _train(model: Any, ids: torch.Tensor) -> Any:
    loss = _loss(model, ids)
    model.backward(loss)
    return loss


def _optimizer_first_body(families: tuple[str, ...], steps: int) -> dict[str, list[str]]:
    """On each of 2 ranks, per family: the plain model's SGD losses, then the model built
    inside smp.tensor_parallelism() with its optimizer made first, wrapped, trained at
    tp 2; what differs, and the parameters a step left unchanged."""
    import torch.distributed as dist

    from smp_fx.world import state

    dist.init_process_group("gloo")  # one group for the families' smp.init calls
    logging.getLogger("transformers").setLevel(logging.ERROR)
    found: dict[str, list[str]] = {}
    for family in families:
        ref = _build(family)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        want = []
        for _ in range(steps):
            ref_opt.zero_grad()
            loss = _loss(ref, _ids())
            loss.backward()
            ref_opt.step()
            want.append(loss.item())

        state._reset()
        smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True,
                  "prescaled_batch": True, "microbatches": 1})
        with smp.tensor_parallelism():
            net = _build(family)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)  # before the wrapping
        model = smp.DistributedModel(net)
        optimizer = smp.DistributedOptimizer(optimizer)

        bad = []
        for step in range(steps):
            optimizer.zero_grad()
            loss = _train(model, _ids()).reduce_mean().item()
            before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
            optimizer.step()
            bad += [f"step {step}: {n} unchanged" for n, p in model.local_named_parameters()
                    if torch.equal(p, before[n])]
            if abs(loss - want[step]) > 1e-5:
                bad.append(f"step {step}: loss {loss} != {want[step]}")
        found[family] = bad
    return found


@pytest.mark.multiproc
def test_optimizer_made_before_wrapping_trains_the_replacement_at_tp2() -> None:
    for rank, found in enumerate(run_ranks(_optimizer_first_body, 2, FAMILIES, 2, timeout=300)):
        assert found == {f: [] for f in FAMILIES}, f"rank {rank}: {found}"


def test_return_dict_false_gives_hugging_faces_tuple() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    ids = _ids()
    for family in ("gpt2", "bert"):
        want = _build(family)(input_ids=ids, labels=ids, return_dict=False)
        init(1, 1, "simple", tensor_parallel_degree=1)
        with smp.tensor_parallelism():
            replaced = smp.DistributedModel(_build(family)).get_module()
        got = replaced(input_ids=ids, labels=ids, return_dict=False)
        assert type(got) is tuple and len(got) == 2  # (loss, logits); no cache is made
        for g, w in zip(got, want[:2]):
            torch.testing.assert_close(g, w)


def test_distributed_optimizer_made_before_the_model_trains_the_replacement() -> None:
    """The other order AWS's scripts use: smp.DistributedOptimizer over the original's
    parameters, then smp.DistributedModel (one process): every parameter moves."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    init(1, 1, "simple")
    with smp.tensor_parallelism():
        net = _build("roberta")
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.5))
    model = smp.DistributedModel(net)

    _train(model, _ids())
    before = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    optimizer.step()
    assert any("seq_layers" in n for n in before)  # the encoder was replaced
    assert [n for n, p in model.local_named_parameters() if torch.equal(p, before[n])] == []
