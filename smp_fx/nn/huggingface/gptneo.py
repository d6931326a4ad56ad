"""``smp.nn.huggingface.gptneo``: Hugging Face's GPT-Neo as SMP distributes it.

``GPTNeoLMHead``: GPT-2's layout with GPT-Neo's unscaled scores and local attention
windows. See docs/tensor_parallel.md.

>>> import torch
>>> sd = {"transformer.wpe.weight": torch.zeros(8, 4)}
>>> sorted(translate_hf_state_dict_to_smdistributed_gptneo(sd))
['position_embedding.weight']
"""

from __future__ import annotations

import logging
from typing import Any

from cost_model.errors import not_implemented
from smp_fx.nn.huggingface import registry
from smp_fx.nn.huggingface.causal_lm import CausalLMHead, Layout
from smp_fx.nn.huggingface.gpt2 import ACTIVATIONS
from smp_fx.nn.huggingface.translate import Rename, hf_to_smp, smp_to_hf

log = logging.getLogger(__name__)

HF_CLASS = "transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoForCausalLM"
FAMILY = "GPT-Neo"
_H = "transformer.h.{layer}."
_L = "transformer.seq_layers.{layer}."
RULES = (
    Rename("transformer.wte.weight", "word_embedding.weight"),
    Rename("transformer.wpe.weight", "position_embedding.weight"),
    Rename(_H + "ln_1.{kind}", _L + "attention.pre_layernorm.{kind}"),
    *(Rename(_H + f"attn.attention.{hf}_proj.{{kind}}", _L + f"attention.{smp}.{{kind}}")
      for hf, smp in (("q", "query"), ("k", "key"), ("v", "value"), ("out", "dense"))),
    Rename(_H + "ln_2.{kind}", _L + "output.pre_layernorm.{kind}"),
    Rename(_H + "mlp.c_fc.{kind}", _L + "output.dense1.{kind}"),
    Rename(_H + "mlp.c_proj.{kind}", _L + "output.dense2.{kind}"),
    Rename("transformer.ln_f.{kind}", "transformer.seq_layers.{last}.output.layernorm.{kind}"),
    Rename("lm_head.weight", "lm_head.weight"),
)
DROPPED = (_H + "attn.attention.bias", _H + "attn.attention.masked_bias")


def translate_hf_state_dict_to_smdistributed_gptneo(state_dict: dict[str, Any]
                                                    ) -> dict[str, Any]:
    """A ``GPTNeoForCausalLM`` state dict in ``GPTNeoLMHead``'s (SMP's) names."""
    return hf_to_smp(state_dict, RULES, FAMILY, "transformer.h", DROPPED)


translate_hf_gptneo_state_dict_to_smdistributed = \
    translate_hf_state_dict_to_smdistributed_gptneo
"""The spelling AWS's GPT-Neo script imports."""


def translate_state_dict_to_hf_gptneo(state_dict: dict[str, Any],
                                      max_seq_len: int | None = None) -> dict[str, Any]:
    """A ``GPTNeoLMHead`` (SMP) state dict in ``GPTNeoForCausalLM``'s names. ``max_seq_len``
    (AWS's script passes it) asked SMP for transformers 4.2x's mask buffers, which depend
    on each layer's window: they are not written (transformers 4.3x and later keep none)."""
    if max_seq_len is not None:
        log.info("smp-fx: translate_state_dict_to_hf_gptneo writes no attention-mask "
                 "buffers (max_seq_len=%d); transformers 4.3x and later need none",
                 max_seq_len)
    return smp_to_hf(state_dict, RULES, FAMILY, "transformer.seq_layers")


def layout(config: Any) -> Layout:
    """``GPTNeoLMHead``'s arguments for a ``GPTNeoConfig``; what it cannot compute is
    refused."""
    if config.activation_function not in ACTIVATIONS:
        raise not_implemented(f"activation {config.activation_function!r} in the "
                              "distributed GPT-Neo", "GPTNeoConfig.activation_function",
                              f"use one of {sorted(ACTIVATIONS)}")
    kwargs = {"num_layers": config.num_layers, "num_attention_heads": config.num_heads,
              "attention_head_size": config.hidden_size // config.num_heads,
              "hidden_size": config.hidden_size,
              "intermediate_size": config.intermediate_size or 4 * config.hidden_size,
              "vocab_size": config.vocab_size,
              "num_positions": config.max_position_embeddings,
              "attention_dropout_prob": config.attention_dropout,
              "hidden_dropout_prob": config.resid_dropout,
              "activation": ACTIVATIONS[config.activation_function],
              "layernorm_epsilon": config.layer_norm_epsilon,
              "initializer_range": config.initializer_range,
              "use_normal_initialization": True,
              "causal_mask_size": config.max_position_embeddings,
              "pre_layernorm": True, "post_layernorm": True,
              "scale_attention_scores": False}
    options = [{"query_key_value_bias": False,
                "window_size": config.window_size if kind == "local" else None}
               for kind in config.attention_layers]
    return Layout(kwargs, options, embedding_dropout=config.embed_dropout)


class GPTNeoLMHead(CausalLMHead):
    """``GPTNeoForCausalLM`` as SMP replaces it (module docstring)."""

    family = FAMILY

    def __init__(self, config: Any, **overrides: Any) -> None:
        super().__init__(config, layout(config), **overrides)


registry.register_lm(HF_CLASS, GPTNeoLMHead, (translate_state_dict_to_hf_gptneo,
                                              translate_hf_state_dict_to_smdistributed_gptneo))

__all__ = ["GPTNeoLMHead", "translate_hf_gptneo_state_dict_to_smdistributed",
           "translate_hf_state_dict_to_smdistributed_gptneo",
           "translate_state_dict_to_hf_gptneo"]
