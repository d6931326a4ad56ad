"""SMP's distributed GPT-J, GPT-Neo and GPT-NeoX: created for tensor parallelism, each
Hugging Face model is replaced by ``smp.nn``'s transformer with the structure scripts read
(``transformer.seq_layers``), computes what the original computed, translates both ways,
trains equal to the Hugging Face model at pp 2 (in one process) and at pp 2 x tp 2 (four
ranks, the three families in one spawn), and a trained one exports to Hugging Face
(``smp.save_checkpoint(partial=False)`` -> ``from_pretrained``) with the trained logits."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.nn.huggingface import gptj, gptneo, gptneox
from smp_fx.world import state
from tests.helpers.dist import run_ranks
from tests.helpers.numerics import init

FAMILIES = ("gptj", "gptneo", "gptneox", "gptneox_sequential")
TOL = {"rtol": 1e-5, "atol": 1e-5}
STEPS = 3
LR = 0.5  # SGD: Adam's first steps turn rounding in near-zero gradients into whole steps


def config(family: str) -> Any:
    """A tiny config of ``family``: 2 layers, width 32, 4 heads, vocabulary 64, partial
    rotary embeddings, GPT-Neo's local window shorter than the sequence; no dropout."""
    import transformers as t

    eager = {"use_cache": False, "attn_implementation": "eager"}
    if family == "gptj":
        return t.GPTJConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                            rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            **eager)
    if family == "gptneo":
        return t.GPTNeoConfig(vocab_size=64, max_position_embeddings=32, hidden_size=32,
                              num_layers=2, num_heads=4, window_size=4,
                              attention_types=[[["global", "local"], 1]], resid_dropout=0.0,
                              embed_dropout=0.0, attention_dropout=0.0, **eager)
    return t.GPTNeoXConfig(vocab_size=64, max_position_embeddings=32, hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0,
                           use_parallel_residual=family == "gptneox", **eager)


TRANSLATE = {  # (hf -> smp, smp -> hf) as SMP's public functions are called
    "gptj": (gptj.translate_hf_state_dict_to_smdistributed_gptj,
             gptj.translate_state_dict_to_hf_gptj),
    "gptneo": (gptneo.translate_hf_state_dict_to_smdistributed_gptneo,
               gptneo.translate_state_dict_to_hf_gptneo),
    "gptneox": (lambda sd: gptneox.translate_hf_state_dict_to_smdistributed_gptneox(sd, 4),
                lambda sd: gptneox.translate_state_dict_to_hf_gptneox(sd, 4)),
}
REPLACEMENT = {"gptj": gptj.GPTJLMHead, "gptneo": gptneo.GPTNeoLMHead,
               "gptneox": gptneox.GPTNeoXLMHead}


def _kind(family: str) -> str:
    return family.split("_")[0]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # padding at the end of one sample
    return ids, mask


def reference(family: str) -> tuple[list[float], torch.Tensor]:
    """The Hugging Face model trained in one process: losses, then the trained logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(family))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids, mask = batch()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        return losses, model(input_ids=ids, attention_mask=mask).logits


def train_replaced(family: str) -> tuple[smp.DistributedModel, list[float], Any]:
    """The script's path: created in ``smp.model_creation(tensor_parallelism=True)``,
    wrapped, trained ``STEPS`` SGD steps; (model, losses, the logits step function)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True, dtype=torch.float32):
        model = smp.DistributedModel(AutoModelForCausalLM.from_config(config(family)))
    optimizer = smp.DistributedOptimizer(
        torch.optim.SGD(model.get_module().parameters(), lr=LR))

    @smp.step
    def train(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        model.backward(out["loss"])
        return out["loss"]

    @smp.step
    def logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        return model(input_ids=ids, attention_mask=mask, labels=ids)["logits"]

    ids, mask = batch()
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses.append(train(model, ids, mask).reduce_mean().item())
        optimizer.step()
    return model, losses, lambda: logits(model, ids, mask).concat()


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    yield
    smp.reset()
    state._reset()


@pytest.mark.parametrize("family", FAMILIES)
def test_replaced_with_the_original_function_and_translated_both_ways(family: str) -> None:
    init(1, 1, "simple", ddp=True)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        original = AutoModelForCausalLM.from_config(config(family))
    ids, mask = batch()
    with torch.no_grad():
        want = original(input_ids=ids, attention_mask=mask, labels=ids)
    module = smp.DistributedModel(original).get_module()
    assert type(module) is REPLACEMENT[_kind(family)]
    assert len(module.transformer.seq_layers) == 2 and all(
        isinstance(c, smp.nn.DistributedTransformerLayer)
        for c in module.transformer.seq_layers.children())
    with torch.no_grad():
        got = module(input_ids=ids, attention_mask=mask, labels=ids)
        loss, logits = module(input_ids=ids, attention_mask=mask, labels=ids,
                              return_dict=False)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert torch.equal(logits, got.logits) and torch.equal(loss, got.loss)
    to_smp, to_hf = TRANSLATE[_kind(family)]
    hf = original.state_dict()
    assert set(to_smp(hf)) == set(module.state_dict())
    back = to_hf(module.state_dict())
    assert set(back) == set(hf)
    if family == "gptneo":  # AWS's script's spelling and its max_seq_len argument
        assert gptneo.translate_hf_gptneo_state_dict_to_smdistributed is to_smp
        assert set(to_hf(module.state_dict(), 32)) == set(hf)
    for name in hf:
        torch.testing.assert_close(back[name], hf[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", ("gptj", "gptneo", "gptneox"))
def test_pp2_trains_equal_and_exports_to_hugging_face(family: str, tmp_path: Path) -> None:
    """Two pipeline stages in one process; the full checkpoint's save_pretrained weights
    load with from_pretrained and give the trained model's logits."""
    from transformers import AutoModelForCausalLM

    want, trained = reference(family)
    init(2, 2, "interleaved", ddp=True)
    model, losses, logits = train_replaced(family)
    torch.testing.assert_close(losses, want, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(logits(), trained, **TOL)
    # the full checkpoint in Hugging Face's names (smp.state.module_manager's translation)
    smp.save_checkpoint(str(tmp_path), tag="fullmodel.pt", partial=False, model=model)
    export = AutoModelForCausalLM.from_config(config(family))
    export.load_state_dict(torch.load(tmp_path / "fullmodel.pt"))
    export.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids, mask = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask).logits,
                                   trained, **TOL)


def _pp2_tp2_rank() -> dict[str, Any]:
    """The three families in turn, under one ``smp.init`` (pp 2 x tp 2, 4 ranks)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2,
              "ddp": True, "prescaled_batch": True})
    out: dict[str, Any] = {}
    for family in ("gptj", "gptneo", "gptneox"):
        model, losses, _ = train_replaced(family)
        sharded = [n for n, p in model.local_named_parameters()
                   if model.is_distributed_parameter(p)]
        out[family] = {"losses": losses, "sharded": sharded}
    return out


@pytest.mark.multiproc
def test_pp2_tp2_trains_equal_to_hugging_face_in_one_process() -> None:
    """Tensor parallelism inside each of two pipeline stages (GPT-J alone at tp 2 without
    a pipeline: tests/examples/test_aws_reproductions.py)."""
    wants = {f: reference(f)[0] for f in ("gptj", "gptneo", "gptneox")}
    for res in run_ranks(_pp2_tp2_rank, 4, timeout=240):
        for family, want in wants.items():
            torch.testing.assert_close(res[family]["losses"], want, **TOL, msg=family)
            assert any("attention.query" in n for n in res[family]["sharded"]), family


def test_translating_gptneox_needs_the_head_count() -> None:
    with pytest.raises(smp.SMPCheckpointError, match="num_attention_heads"):
        gptneox.translate_hf_state_dict_to_smdistributed_gptneox({})
    assert isinstance(REPLACEMENT["gptneox"](config("gptneox")).lm_head, nn.Linear)
