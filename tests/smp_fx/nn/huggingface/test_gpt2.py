"""SMP's Hugging Face GPT-2: the translate functions round-trip, a ``GPT2LMHeadModel``
created for tensor parallelism is replaced by ``DistributedTransformerLMHead`` with SMP's
structure and computes what the original computed, and a model trained through it exports
to Hugging Face (``save_pretrained`` / ``from_pretrained``) with the same logits."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import smp_fx as smp
from smp_fx.nn.huggingface.gpt2 import (
    GPT2LMHead,
    translate_hf_state_dict_to_smdistributed_gpt2,
    translate_state_dict_to_hf_gpt2,
)
from smp_fx.world import state
from smp_fx.world.state_api import module_manager
from tests.helpers.numerics import init


def tiny(**extra: Any) -> GPT2Config:
    """The issue's tiny GPT-2: 4 layers, width 64, vocabulary 256, context 64; no dropout."""
    kwargs: dict[str, Any] = {
        "vocab_size": 256, "n_positions": 64, "n_embd": 64, "n_layer": 4, "n_head": 4,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False,
        "bos_token_id": 0, "eos_token_id": 0}
    return GPT2Config(**{**kwargs, **extra})


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield
    smp.reset()
    state._reset()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # padding at the end of one sample
    return ids, mask


def test_translate_round_trip_and_names() -> None:
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(tiny())
    sd = hf.state_dict()
    mine = translate_hf_state_dict_to_smdistributed_gpt2(sd)
    assert set(mine) == set(GPT2LMHead(tiny()).state_dict())
    assert "transformer.seq_layers.3.output.layernorm.weight" in mine  # GPT-2's ln_f
    assert "transformer.seq_layers.2.output.layernorm.weight" not in mine
    torch.testing.assert_close(mine["transformer.seq_layers.1.attention.key.weight"],
                               sd["transformer.h.1.attn.c_attn.weight"][:, 64:128].t())
    back = translate_state_dict_to_hf_gpt2(mine)
    assert set(back) == set(sd)
    for name in sd:
        torch.testing.assert_close(back[name], sd[name], rtol=0, atol=0, msg=name)
    # transformers 4.2x's causal-mask buffers: written on request, dropped on the way in
    old = translate_state_dict_to_hf_gpt2(mine, max_seq_len=64)
    assert old["transformer.h.0.attn.bias"].shape == (1, 1, 64, 64)
    assert float(old["transformer.h.0.attn.masked_bias"]) == -1e4
    assert set(translate_hf_state_dict_to_smdistributed_gpt2(old)) == set(mine)


def test_translate_refuses_what_it_does_not_know() -> None:
    sd = GPT2LMHeadModel(tiny()).state_dict()
    with pytest.raises(smp.SMPCheckpointError, match="'module.transformer.wte.weight'"):
        translate_hf_state_dict_to_smdistributed_gpt2({f"module.{k}": v for k, v in sd.items()})
    mine = translate_hf_state_dict_to_smdistributed_gpt2(sd)
    del mine["transformer.seq_layers.0.attention.value.bias"]
    with pytest.raises(smp.SMPCheckpointError, match="needs all its parts"):
        translate_state_dict_to_hf_gpt2(mine)
    with pytest.raises(smp.SMPCheckpointError, match="no GPT-2 translation rule"):
        translate_state_dict_to_hf_gpt2({"encoder.layer.0.weight": torch.zeros(1)})


def test_replaced_by_the_distributed_transformer_with_the_original_function() -> None:
    """Inside model_creation(tensor_parallelism=True), as AWS's example builds it: wrapping
    gives SMP's structure, the original's weights and its outputs."""
    init(1, 1, "simple", ddp=True)
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True, dtype=torch.float32,
                            query_key_layer_scaling=True, fused_softmax=True,
                            fused_bias_gelu=True, fused_dropout=False,
                            attention_in_fp32=False):
        original = AutoModelForCausalLM.from_config(tiny())
    ids, mask = _batch()
    with torch.no_grad():
        want = original(input_ids=ids, attention_mask=mask, labels=ids)
    model = smp.DistributedModel(original, trace_device="gpu")
    module = model.get_module()
    assert isinstance(module, GPT2LMHead) and isinstance(module,
                                                         smp.nn.DistributedTransformerLMHead)
    assert isinstance(module.transformer.seq_layers, nn.Sequential)
    assert all(isinstance(c, smp.nn.DistributedTransformerLayer)
               for c in module.transformer.seq_layers.children())
    assert module.lm_head.weight is module.word_embedding.weight
    assert smp.DistributedModel(original) is model  # the script's module gives it back
    with pytest.raises(AttributeError, match="transformer.seq_layers"):
        _ = module.h
    with torch.no_grad():
        got = module(input_ids=ids, attention_mask=mask, labels=ids)
    assert type(got) is type(want)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert (translate_state_dict_to_hf_gpt2, translate_hf_state_dict_to_smdistributed_gpt2) \
        in module_manager.translate_functions


def test_not_replaced_outside_tensor_parallelism_and_under_the_context_manager() -> None:
    """Replaced when created for tensor parallelism; marked afterwards, the Hugging Face
    modules stay (the rewrite distributes them directly)."""
    init(1, 1, "simple")
    plain = smp.DistributedModel(GPT2LMHeadModel(tiny()))
    assert type(plain.get_module()) is GPT2LMHeadModel
    smp.reset()
    state._reset()
    init(1, 1, "simple")
    later = GPT2LMHeadModel(tiny())
    smp.set_tensor_parallelism(later)
    assert smp.DistributedModel(later).get_module() is later
    smp.reset()
    state._reset()
    init(1, 1, "simple")
    with smp.tensor_parallelism():
        marked = GPT2LMHeadModel(tiny())
    assert type(smp.DistributedModel(marked).get_module()) is GPT2LMHead


@pytest.mark.parametrize(("field", "value"), [("scale_attn_by_inverse_layer_idx", True),
                                              ("reorder_and_upcast_attn", True),
                                              ("activation_function", "silu")])
def test_configurations_it_cannot_compute_are_refused(field: str, value: Any) -> None:
    with pytest.raises(smp.SMPNotImplementedError, match=field):
        GPT2LMHead(tiny(**{field: value}))


def test_hugging_face_arguments_it_does_not_take_are_refused() -> None:
    module = GPT2LMHead(tiny())
    ids, _ = _batch()
    with pytest.raises(smp.SMPNotImplementedError, match="output_attentions"):
        module(input_ids=ids, output_attentions=True)
    assert type(module(input_ids=ids, return_dict=False)) is tuple  # as Hugging Face's


def test_trained_through_the_distributed_transformer_exports_to_hugging_face(
        tmp_path: Path) -> None:
    """Two pipeline stages in one process, three Adam steps; the full state dict in
    Hugging Face's names loads with from_pretrained and gives the trained model's logits."""
    init(2, 2, "interleaved", ddp=True)
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        model = smp.DistributedModel(AutoModelForCausalLM.from_config(tiny()))
    module = model.get_module()
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(module.parameters(), lr=1e-2))

    @smp.step
    def train(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        model.backward(out["loss"])
        return out["loss"]

    @smp.step
    def logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        # the arguments the model was traced with (labels included), as AWS's test_step
        return model(input_ids=ids, attention_mask=mask, labels=ids)["logits"]

    ids, mask = _batch()
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        losses.append(train(model, ids, mask).reduce_mean().item())
        optimizer.step()
    assert losses[-1] < losses[0]
    with torch.no_grad():
        trained = logits(model, ids, mask).concat()
    hf_state = translate_state_dict_to_hf_gpt2(model.state_dict())
    export = GPT2LMHeadModel(tiny())
    export.load_state_dict(hf_state)
    export.save_pretrained(tmp_path / "hf")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                                   trained, rtol=1e-5, atol=1e-5)
