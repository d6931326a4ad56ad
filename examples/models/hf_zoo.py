"""Tiny Hugging Face models of 27 architectures, each built from a config (no download), for
the tensor-parallel coverage benchmark (benchmarks/tp_coverage.py) and tests.

Each is 2 layers of hidden size 64 (4 heads of 16), vocabulary 128, sequence 16, in eval
mode (no dropout), wrapped so ``forward(*inputs)`` returns the logits: causal and masked
language models take ``input_ids``, encoder-decoders ``(input_ids, decoder_input_ids)``,
image classifiers ``pixel_values`` (16 x 16, 3 channels). ``build(name, marked=True)``
marks the whole model for tensor parallelism (``build``'s docstring says how).

    model = build("gpt_neox")
    logits = model(*inputs("gpt_neox", 2))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, HIDDEN, IMAGE = 128, 16, 64, 16


@dataclass(frozen=True)
class Arch:
    """One architecture: its model class and config (names in ``transformers``), the
    config's arguments, and what it takes (``lm``, ``seq2seq``, ``image``)."""

    model: str
    config: str
    kwargs: dict[str, Any]
    kind: str = "lm"


_LM = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2,
       "num_attention_heads": 4, "max_position_embeddings": 64}
_DECODER = {**_LM, "intermediate_size": 2 * HIDDEN, "num_key_value_heads": 2}
_ENCODER = {**_LM, "intermediate_size": 4 * HIDDEN}

ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", "LlamaConfig", _DECODER),
    "mistral": Arch("MistralForCausalLM", "MistralConfig", _DECODER),
    "mixtral": Arch("MixtralForCausalLM", "MixtralConfig",
                    {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2": Arch("Qwen2ForCausalLM", "Qwen2Config", _DECODER),
    "qwen3": Arch("Qwen3ForCausalLM", "Qwen3Config", {**_DECODER, "head_dim": 16}),
    "gemma": Arch("GemmaForCausalLM", "GemmaConfig",
                  {**_DECODER, "num_key_value_heads": 1, "head_dim": 16}),
    "gemma2": Arch("Gemma2ForCausalLM", "Gemma2Config", {**_DECODER, "head_dim": 16}),
    "olmo2": Arch("Olmo2ForCausalLM", "Olmo2Config",
                  {**_DECODER, "num_key_value_heads": 4, "pad_token_id": 0}),
    "phi": Arch("PhiForCausalLM", "PhiConfig", {**_LM, "intermediate_size": 4 * HIDDEN}),
    "phi3": Arch("Phi3ForCausalLM", "Phi3Config",
                 {**_DECODER, "num_key_value_heads": 4, "pad_token_id": 0}),
    "gpt2": Arch("GPT2LMHeadModel", "GPT2Config",
                 {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": 2, "n_head": 4,
                  "n_positions": 64}),
    "gpt_bigcode": Arch("GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                        {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": 2, "n_head": 4,
                         "n_positions": 64, "multi_query": True}),
    "gptj": Arch("GPTJForCausalLM", "GPTJConfig",
                 {"vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": 2, "n_head": 4,
                  "n_positions": 64, "rotary_dim": 8}),
    "gpt_neo": Arch("GPTNeoForCausalLM", "GPTNeoConfig",
                    {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_layers": 2,
                     "num_heads": 4, "attention_types": [[["global", "local"], 1]],
                     "max_position_embeddings": 64, "window_size": 8}),
    "gpt_neox": Arch("GPTNeoXForCausalLM", "GPTNeoXConfig",
                     {**_LM, "intermediate_size": 4 * HIDDEN}),
    "opt": Arch("OPTForCausalLM", "OPTConfig",
                {"vocab_size": VOCAB, "hidden_size": HIDDEN, "ffn_dim": 4 * HIDDEN,
                 "num_hidden_layers": 2, "num_attention_heads": 4,
                 "max_position_embeddings": 64, "word_embed_proj_dim": HIDDEN}),
    "bloom": Arch("BloomForCausalLM", "BloomConfig",
                  {"vocab_size": VOCAB, "hidden_size": HIDDEN, "n_layer": 2, "n_head": 4}),
    "falcon": Arch("FalconForCausalLM", "FalconConfig",
                   {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "new_decoder_architecture": False,
                    "multi_query": True, "parallel_attn": True, "bias": False}),
    "bert": Arch("BertForMaskedLM", "BertConfig", _ENCODER),
    "roberta": Arch("RobertaForMaskedLM", "RobertaConfig", {**_ENCODER, "pad_token_id": 1}),
    "albert": Arch("AlbertForMaskedLM", "AlbertConfig", {**_ENCODER, "embedding_size": 32}),
    "electra": Arch("ElectraForMaskedLM", "ElectraConfig",
                    {**_ENCODER, "embedding_size": HIDDEN}),
    "deberta_v2": Arch("DebertaV2ForMaskedLM", "DebertaV2Config",
                       {**_ENCODER, "relative_attention": True, "position_buckets": 8,
                        "pos_att_type": ["p2c", "c2p"]}),
    "bart": Arch("BartForConditionalGeneration", "BartConfig",
                 {"vocab_size": VOCAB, "d_model": HIDDEN, "encoder_layers": 2,
                  "decoder_layers": 2, "encoder_attention_heads": 4,
                  "decoder_attention_heads": 4, "encoder_ffn_dim": 4 * HIDDEN,
                  "decoder_ffn_dim": 4 * HIDDEN, "max_position_embeddings": 64}, "seq2seq"),
    "t5": Arch("T5ForConditionalGeneration", "T5Config",
               {"vocab_size": VOCAB, "d_model": HIDDEN, "d_kv": 16, "d_ff": 4 * HIDDEN,
                "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
                "decoder_start_token_id": 0}, "seq2seq"),
    "vit": Arch("ViTForImageClassification", "ViTConfig",
                {"image_size": IMAGE, "patch_size": 4, "num_channels": 3,
                 "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "intermediate_size": 4 * HIDDEN, "num_labels": 10}, "image"),
    "swin": Arch("SwinForImageClassification", "SwinConfig",
                 {"image_size": IMAGE, "patch_size": 2, "num_channels": 3, "embed_dim": 32,
                  "depths": [1, 1], "num_heads": [4, 8], "window_size": 4,
                  "num_labels": 10}, "image"),
}
"""Each entry's config; 27 architectures (SMP itself distributed GPT-2, BERT, RoBERTa,
GPT-J and GPT-Neo)."""


class Logits(nn.Module):
    """``forward(*inputs) -> logits`` over a Hugging Face model (kept untouched)."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model = model
        self.kind = kind

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.kind == "seq2seq":
            out = self.model(input_ids=inputs[0], decoder_input_ids=inputs[1])
        elif self.kind == "image":
            out = self.model(pixel_values=inputs[0])
        else:
            out = self.model(input_ids=inputs[0])
        logits: torch.Tensor = out.logits
        return logits


def build(name: str, marked: bool = True, seed: int = 0,
          attention: str = "eager") -> nn.Module:
    """Architecture ``name`` from its config (seed ``seed``), marked whole for tensor
    parallelism unless ``marked`` is False; ``attention`` is the Hugging Face attention
    implementation ("eager", or "sdpa", transformers' default where the model has it).

    Marked by ``smp.set_tensor_parallelism`` once built, so what is sharded is Hugging
    Face's own model: built inside ``smp.tensor_parallelism()``, as SMP does, GPT-2, GPT-J,
    GPT-Neo, GPT-NeoX and BERT's and RoBERTa's encoders would be replaced by SMP's
    distributed modules
    (``smp_fx.nn.huggingface``, tested on their own); every other architecture is marked
    alike either way."""
    import transformers

    import smp_fx as smp

    arch = ARCHITECTURES[name]
    config = getattr(transformers, arch.config)(**arch.kwargs)
    config._attn_implementation = attention
    torch.manual_seed(seed)
    model = Logits(getattr(transformers, arch.model)(config), arch.kind)
    if marked:
        smp.set_tensor_parallelism(model)
    return model.eval()


def inputs(name: str, batch_size: int = 2, seq: int = SEQ) -> tuple[torch.Tensor, ...]:
    """A batch for architecture ``name``, of ``seq`` tokens (an image model's is an image)."""
    kind = ARCHITECTURES[name].kind
    if kind == "image":
        return (torch.randn(batch_size, 3, IMAGE, IMAGE),)
    ids = (torch.randint(0, VOCAB, (batch_size, seq)),)
    return ids * 2 if kind == "seq2seq" else ids


def targets(name: str, batch_size: int = 2, seq: int = SEQ) -> torch.Tensor:
    """Class targets for ``inputs(name, batch_size, seq)``'s logits."""
    if ARCHITECTURES[name].kind == "image":
        return torch.randint(0, 10, (batch_size,))
    return torch.randint(0, VOCAB, (batch_size, seq))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits (per token for language models)."""
    return F.cross_entropy(output.flatten(0, -2), target.flatten())



def build_model(arch: str = "gpt_neox", marked: bool = True) -> nn.Module:
    """The example-model convention (``smp-fx partition examples/models/hf_zoo.py
    --build-arg arch=opt --inputs-arg arch=opt``)."""
    return build(arch, marked)


def example_inputs(batch_size: int = 2, arch: str = "gpt_neox") -> tuple[torch.Tensor, ...]:
    return inputs(arch, batch_size)


def example_targets(batch_size: int = 2, arch: str = "gpt_neox") -> torch.Tensor:
    return targets(arch, batch_size)


__all__ = ["ARCHITECTURES", "Arch", "Logits", "build", "build_model", "example_inputs",
           "example_targets", "inputs", "loss_fn", "targets"]
