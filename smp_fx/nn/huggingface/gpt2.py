"""``smp.nn.huggingface.gpt2``: Hugging Face's GPT-2 as SMP distributes it.

A ``GPT2LMHeadModel`` created for tensor parallelism becomes ``GPT2LMHead`` when wrapped
(scripts read ``transformer.seq_layers``), starting from its translated weights and
computing Hugging Face's function exactly (``gelu_new``, not SMP's erf GELU).
``max_seq_len`` writes transformers 4.2x's attention buffers. See docs/tensor_parallel.md.

>>> import torch
>>> sd = {"transformer.wte.weight": torch.zeros(8, 4), "lm_head.weight": torch.zeros(8, 4)}
>>> sorted(translate_hf_state_dict_to_smdistributed_gpt2(sd))
['lm_head.weight', 'word_embedding.weight']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cost_model.errors import SMPConfigError, not_implemented
from smp_fx.nn.huggingface import registry
from smp_fx.nn.huggingface.translate import Fused, Rename, hf_to_smp, smp_to_hf
from smp_fx.nn.huggingface.unbuilt import layer_hooks
from smp_fx.nn.transformer import DistributedTransformerLMHead, lm_loss

HF_CLASS = "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
FAMILY = "GPT-2"
_L = "transformer.seq_layers.{layer}."
RULES = (
    Rename("transformer.wte.weight", "word_embedding.weight"),
    Rename("transformer.wpe.weight", "position_embedding.weight"),
    Rename("transformer.h.{layer}.ln_1.{kind}", _L + "attention.pre_layernorm.{kind}"),
    Fused("transformer.h.{layer}.attn.c_attn.{kind}",
          tuple(_L + f"attention.{p}.{{kind}}" for p in ("query", "key", "value")),
          transpose=True),
    Rename("transformer.h.{layer}.attn.c_proj.{kind}", _L + "attention.dense.{kind}",
           transpose=True),
    Rename("transformer.h.{layer}.ln_2.{kind}", _L + "output.pre_layernorm.{kind}"),
    Rename("transformer.h.{layer}.mlp.c_fc.{kind}", _L + "output.dense1.{kind}",
           transpose=True),
    Rename("transformer.h.{layer}.mlp.c_proj.{kind}", _L + "output.dense2.{kind}",
           transpose=True),
    Rename("transformer.ln_f.{kind}", "transformer.seq_layers.{last}.output.layernorm.{kind}"),
    Rename("lm_head.weight", "lm_head.weight"),
)
DROPPED = ("transformer.h.{layer}.attn.bias", "transformer.h.{layer}.attn.masked_bias")
ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu",
               "relu": "relu"}


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: dict[str, Any]
                                                  ) -> dict[str, Any]:
    """A ``GPT2LMHeadModel`` state dict in ``GPT2LMHead``'s (SMP's) names and layouts."""
    return hf_to_smp(state_dict, RULES, FAMILY, "transformer.h", DROPPED)


def translate_state_dict_to_hf_gpt2(state_dict: dict[str, Any],
                                    max_seq_len: int | None = None) -> dict[str, Any]:
    """A ``GPT2LMHead`` (SMP) state dict in ``GPT2LMHeadModel``'s names and layouts; with
    ``max_seq_len``, transformers 4.2x's causal-mask buffers too (module docstring)."""
    out = smp_to_hf(state_dict, RULES, FAMILY, "transformer.seq_layers")
    if max_seq_len is not None:
        causal = torch.tril(torch.ones(max_seq_len, max_seq_len, dtype=torch.uint8))
        for key in [k for k in out if k.endswith(".attn.c_attn.weight")]:
            prefix = key[:-len("c_attn.weight")]
            out[prefix + "bias"] = causal.view(1, 1, max_seq_len, max_seq_len)
            out[prefix + "masked_bias"] = torch.tensor(-1e4)
    return out


def init_kwargs(config: Any) -> dict[str, Any]:
    """``DistributedTransformerLMHead``'s arguments for a ``GPT2Config`` (SMP's mapping);
    what the replacement cannot compute exactly is refused, naming the field."""
    where = "GPT2LMHeadModel -> DistributedTransformerLMHead"
    if config.n_embd % config.n_head:
        raise SMPConfigError.build("n_embd must be divisible by n_head",
                                   (config.n_embd, config.n_head), where,
                                   "use a head count that divides the width")
    unsupported = {"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True,
                   "reorder_and_upcast_attn": True, "add_cross_attention": True}
    for field, bad in unsupported.items():
        if bool(getattr(config, field, not bad)) == bad:
            raise not_implemented(f"GPT2Config.{field}={bad} in the distributed GPT-2",
                                  field, f"set {field}={not bad}, or create the model "
                                  "outside smp.model_creation(tensor_parallelism=True)")
    return gpt2_style_kwargs(config, FAMILY)


def gpt2_style_kwargs(config: Any, family: str) -> dict[str, Any]:
    """The transformer's arguments from GPT-2's field names (``n_layer``, ``n_embd``, ...),
    which GPT-J's configuration shares; an activation it cannot compute is refused."""
    if config.activation_function not in ACTIVATIONS:
        raise not_implemented(f"activation {config.activation_function!r} in the "
                              f"distributed {family}",
                              f"{type(config).__name__}.activation_function",
                              f"use one of {sorted(ACTIVATIONS)}")
    return {"num_layers": config.n_layer, "num_attention_heads": config.n_head,
            "attention_head_size": config.n_embd // config.n_head,
            "hidden_size": config.n_embd,
            "intermediate_size": config.n_inner or 4 * config.n_embd,
            "vocab_size": config.vocab_size, "num_positions": config.n_positions,
            "attention_dropout_prob": config.attn_pdrop,
            "hidden_dropout_prob": config.resid_pdrop,
            "activation": ACTIVATIONS[config.activation_function],
            "layernorm_epsilon": config.layer_norm_epsilon,
            "initializer_range": config.initializer_range,
            "use_normal_initialization": True, "causal_mask_size": config.n_positions,
            "pre_layernorm": True, "post_layernorm": True}


class GPT2LMHead(DistributedTransformerLMHead):
    """``GPT2LMHeadModel`` as SMP replaces it (module docstring): SMP's structure, Hugging
    Face's arguments, outputs and function. ``config`` is the ``GPT2Config``."""

    def __init__(self, config: Any, **overrides: Any) -> None:
        super().__init__(**{**init_kwargs(config), **overrides})
        self.config = config
        self.dropout = nn.Dropout(config.embd_pdrop)

    # GPT2LMHeadModel's arguments, not the LM head's tuple: the replacement is called as the
    # Hugging Face model it replaces
    def forward(self, input_ids: torch.Tensor | None = None,  # type: ignore[override]
                past_key_values: Any = None,
                attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, head_mask: Any = None,
                inputs_embeds: Any = None, encoder_hidden_states: Any = None,
                encoder_attention_mask: Any = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                cache: Any = None, logits_to_keep: int = 0) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

        refuse_arguments(
            "GPT-2", past_key_values=past_key_values, cache=cache, head_mask=head_mask,
            inputs_embeds=inputs_embeds, encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            logits_to_keep=logits_to_keep)
        if input_ids is None:
            raise SMPConfigError.build("the distributed GPT-2 needs input_ids", None,
                                       "GPT2LMHead.forward", "pass input_ids")
        # Hugging Face's mask keeps 1s and masks 0s; the LM head's masks the 1s
        padding = None if attention_mask is None else 1 - attention_mask
        hidden = self.body(self.embed(input_ids, token_type_ids, position_ids), padding)
        assert self.lm_head is not None
        logits = self.lm_head(hidden)
        loss = None if labels is None else lm_loss(logits, labels)
        out = CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)
        return out.to_tuple() if return_dict is False else out  # as GPT2LMHeadModel's

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("h", "wte", "wpe", "ln_f"):
                raise AttributeError(
                    f"'{name}' is a GPT2LMHeadModel attribute; the model was replaced by "
                    "SMP's DistributedTransformerLMHead (created for tensor parallelism): "
                    "its layers are transformer.seq_layers, its embeddings word_embedding "
                    "and position_embedding") from None
            raise


def refuse_arguments(family: str, **values: Any) -> None:
    """Hugging Face arguments the distributed ``family`` model does not take (SMP refused
    them): each given one is an error naming it."""
    for name, value in values.items():
        if not (value is None or value is False or (type(value) is int and value == 0)):
            raise not_implemented(f"{name} in the distributed {family}", name,
                                  f"leave {name} unset (training and evaluation calls "
                                  "with input_ids, attention_mask and labels run)")


get_hf_gpt2_transformer_layer_hooks = layer_hooks(
    "get_hf_gpt2_transformer_layer_hooks", FAMILY, "GPT2Block", "GPT2LMHeadModel", "gpt2")

registry.register_lm(HF_CLASS, GPT2LMHead, (translate_state_dict_to_hf_gpt2,
                                            translate_hf_state_dict_to_smdistributed_gpt2))

__all__ = ["GPT2LMHead", "get_hf_gpt2_transformer_layer_hooks",
           "translate_hf_state_dict_to_smdistributed_gpt2",
           "translate_state_dict_to_hf_gpt2"]
