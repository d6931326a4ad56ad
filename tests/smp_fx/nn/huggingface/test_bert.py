"""SMP's BERT and RoBERTa encoders: created for tensor parallelism, the Hugging Face
encoder is replaced by ``DistributedTransformer`` (``seq_layers``) with its weights and
function (padding masks included), trains in a two-stage pipeline like the original, and
the translate functions round-trip a whole model's state dict."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, RobertaConfig, RobertaForMaskedLM

import smp_fx as smp
from smp_fx.nn.huggingface import bert, roberta
from smp_fx.world import state
from tests.helpers.dist import run_ranks
from tests.helpers.numerics import init

FAMILIES = {
    "bert": (BertConfig, BertForMaskedLM, bert.translate_hf_state_dict_to_smdistributed_bert,
             bert.translate_state_dict_to_hf_bert),
    "roberta": (RobertaConfig, RobertaForMaskedLM,
                roberta.translate_hf_state_dict_to_smdistributed_roberta,
                roberta.translate_state_dict_to_hf_roberta),
}


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield
    smp.reset()
    state._reset()


def _config(cls: Any, **extra: Any) -> Any:
    return cls(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, pad_token_id=1, **extra)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_translate_round_trip(family: str) -> None:
    config_cls, model_cls, to_smp, to_hf = FAMILIES[family]
    sd = model_cls(_config(config_cls)).state_dict()
    mine = to_smp(sd)
    assert f"{family}.encoder.seq_layers.1.output.dense2.weight" in mine
    assert not any(".encoder.layer." in k for k in mine)
    back = to_hf(mine)
    assert set(back) == set(sd)
    assert all(back[k] is sd[k] for k in sd)  # renamed, not copied


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_encoder_replaced_and_trains_like_the_original(family: str) -> None:
    config_cls, model_cls, _, _ = FAMILIES[family]
    init(2, 2, "interleaved", ddp=True)
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        original = model_cls(_config(config_cls))
    reference = model_cls(_config(config_cls))
    reference.load_state_dict(original.state_dict())
    model = smp.DistributedModel(original)
    encoder = model.get_module().base_model.encoder
    assert isinstance(encoder, bert.BertTransformer)
    assert isinstance(encoder, smp.nn.DistributedTransformer)
    assert len(encoder.seq_layers) == 2
    with pytest.raises(AttributeError, match="seq_layers"):
        _ = encoder.layer
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    @smp.step
    def train(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        model.backward(out["loss"])
        return out["loss"]

    ids, mask = _batch()
    for _ in range(3):
        optimizer.zero_grad()
        ref_opt.zero_grad()
        loss = train(model, ids, mask).reduce_mean()
        want = sum(reference(input_ids=i, attention_mask=m, labels=i).loss
                   for i, m in zip(ids.chunk(2), mask.chunk(2))) / 2
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        optimizer.step()
        ref_opt.step()


def test_configurations_it_cannot_compute_are_refused() -> None:
    with pytest.raises(smp.SMPNotImplementedError, match="is_decoder"):
        bert.BertTransformer(_config(BertConfig, is_decoder=True))
    with pytest.raises(smp.SMPNotImplementedError, match="hidden_act"):
        bert.BertTransformer(_config(BertConfig, hidden_act="silu"))


def _tp_body(tp: int) -> tuple[list[float], int, int]:
    """BertForMaskedLM created for tensor parallelism, tp ranks on their own halves of the
    batch (prescaled_batch false); the data-parallel mean loss of three SGD steps."""
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": tp, "ddp": True})
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        model = smp.DistributedModel(BertForMaskedLM(_config(BertConfig)))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        model.backward(out["loss"])
        return out["loss"]

    ids, mask = _batch()
    part = 4 // smp.dp_size()
    ids, mask = (t[smp.dp_rank() * part:(smp.dp_rank() + 1) * part] for t in (ids, mask))
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = train(model, ids, mask).reduce_mean().detach()
        torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
        optimizer.step()
        losses.append(loss.item() / smp.dp_size())
    plan = model.tp_plan
    return losses, len(plan.sharded) if plan else 0, len(plan.replicated) if plan else 0


@pytest.mark.multiproc
def test_replaced_encoder_is_sharded_at_tp2_and_trains_like_one_process() -> None:
    """Only the encoder is distributed (the embeddings, pooler and heads created with it
    stay whole, as SMP's): every encoder linear sharded, nothing replicated."""
    (want, _, _), = run_ranks(_tp_body, 1, 1, timeout=120)
    got = run_ranks(_tp_body, 2, 2, timeout=180)
    for losses, sharded, replicated in got:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5,
                                   atol=1e-6)
        # per layer: the six linear weights and the four column-parallel biases
        assert sharded == 2 * 10 and replicated == 0
