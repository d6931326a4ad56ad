"""``smp.nn.huggingface.gptj``: Hugging Face's GPT-J as SMP distributes it.

``GPTJLMHead``: parallel attention and MLP behind one layer norm, interleaved rotary
embeddings, no position table, an LM head of its own. See docs/tensor_parallel.md.

>>> import torch
>>> sd = {"transformer.wte.weight": torch.zeros(8, 4), "lm_head.bias": torch.zeros(8)}
>>> sorted(translate_hf_state_dict_to_smdistributed_gptj(sd))
['lm_head.bias', 'word_embedding.weight']
"""

from __future__ import annotations

from typing import Any

from cost_model.errors import not_implemented
from smp_fx.nn.huggingface import registry
from smp_fx.nn.huggingface.causal_lm import CausalLMHead, Layout
from smp_fx.nn.huggingface.gpt2 import gpt2_style_kwargs
from smp_fx.nn.huggingface.translate import Rename, hf_to_smp, smp_to_hf
from smp_fx.nn.huggingface.unbuilt import layer_hooks

HF_CLASS = "transformers.models.gptj.modeling_gptj.GPTJForCausalLM"
FAMILY = "GPT-J"
_H = "transformer.h.{layer}."
_L = "transformer.seq_layers.{layer}."
RULES = (
    Rename("transformer.wte.weight", "word_embedding.weight"),
    Rename(_H + "ln_1.{kind}", _L + "attention.pre_layernorm.{kind}"),
    *(Rename(_H + f"attn.{hf}_proj.weight", _L + f"attention.{smp}.weight")
      for hf, smp in (("q", "query"), ("k", "key"), ("v", "value"), ("out", "dense"))),
    Rename(_H + "mlp.fc_in.{kind}", _L + "output.dense1.{kind}"),
    Rename(_H + "mlp.fc_out.{kind}", _L + "output.dense2.{kind}"),
    Rename("transformer.ln_f.{kind}", "transformer.seq_layers.{last}.output.layernorm.{kind}"),
    Rename("lm_head.{kind}", "lm_head.{kind}"),
)
DROPPED = (_H + "attn.bias", _H + "attn.masked_bias", _H + "attn.embed_positions")


def translate_hf_state_dict_to_smdistributed_gptj(state_dict: dict[str, Any]
                                                  ) -> dict[str, Any]:
    """A ``GPTJForCausalLM`` state dict in ``GPTJLMHead``'s (SMP's) names."""
    return hf_to_smp(state_dict, RULES, FAMILY, "transformer.h", DROPPED)


translate_hf_gptj_state_dict_to_smdistributed = translate_hf_state_dict_to_smdistributed_gptj
"""The spelling AWS's GPT-J script imports."""


def translate_state_dict_to_hf_gptj(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A ``GPTJLMHead`` (SMP) state dict in ``GPTJForCausalLM``'s names."""
    return smp_to_hf(state_dict, RULES, FAMILY, "transformer.seq_layers")


def layout(config: Any) -> Layout:
    """``GPTJLMHead``'s arguments for a ``GPTJConfig``; what it cannot compute is refused."""
    kwargs = gpt2_style_kwargs(config, FAMILY)
    if not config.rotary_dim:
        raise not_implemented("GPT-J without rotary_dim (Hugging Face's own model needs "
                              "one head then)", "GPTJConfig.rotary_dim",
                              "set rotary_dim (GPT-J 6B: 64)")
    options = {"shared_layernorm": True, "rotary_dim": config.rotary_dim,
               "rotary_interleaved": True, "query_key_value_bias": False,
               "dense_bias": False}
    return Layout(kwargs, [options] * config.n_layer, positions=False, tied=False,
                  head_bias=True, embedding_dropout=config.embd_pdrop)


class GPTJLMHead(CausalLMHead):
    """``GPTJForCausalLM`` as SMP replaces it (module docstring)."""

    family = FAMILY

    def __init__(self, config: Any, **overrides: Any) -> None:
        super().__init__(config, layout(config), **overrides)


get_hf_gptj_transformer_hooks = layer_hooks(
    "get_hf_gptj_transformer_hooks", FAMILY, "GPTJBlock", "GPTJForCausalLM", "gptj")

registry.register_lm(HF_CLASS, GPTJLMHead, (translate_state_dict_to_hf_gptj,
                                            translate_hf_state_dict_to_smdistributed_gptj))

__all__ = ["GPTJLMHead", "get_hf_gptj_transformer_hooks",
           "translate_hf_gptj_state_dict_to_smdistributed",
           "translate_hf_state_dict_to_smdistributed_gptj", "translate_state_dict_to_hf_gptj"]
