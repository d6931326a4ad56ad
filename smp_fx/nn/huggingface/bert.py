"""``smp.nn.huggingface.bert``: Hugging Face's BERT encoder as SMP distributes it.

A ``BertEncoder`` created for tensor parallelism is replaced by ``BertTransformer``
(SMP's ``seq_layers``, starting from the encoder's weights, taking its arguments); the
embeddings, pooler and heads stay Hugging Face's. See docs/tensor_parallel.md.

>>> import torch
>>> sd = {"bert.encoder.layer.0.intermediate.dense.bias": torch.zeros(8),
...       "bert.pooler.dense.bias": torch.zeros(4)}
>>> sorted(translate_hf_state_dict_to_smdistributed_bert(sd))
['bert.encoder.seq_layers.0.output.dense1.bias', 'bert.pooler.dense.bias']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cost_model.errors import SMPConfigError, not_implemented
from smp_fx.nn.attention import MASKED
from smp_fx.nn.huggingface import registry
from smp_fx.nn.huggingface.translate import Rename, hf_to_smp, smp_to_hf
from smp_fx.nn.transformer import DistributedTransformer

HF_CLASS = "transformers.models.bert.modeling_bert.BertEncoder"
_HF = "{prefix}encoder.layer.{layer}."
_SMP = "{prefix}encoder.seq_layers.{layer}."
RULES = (
    *(Rename(_HF + f"attention.self.{p}.{{kind}}", _SMP + f"attention.{p}.{{kind}}")
      for p in ("query", "key", "value")),
    Rename(_HF + "attention.output.dense.{kind}", _SMP + "attention.dense.{kind}"),
    Rename(_HF + "attention.output.LayerNorm.{kind}", _SMP + "attention.layernorm.{kind}"),
    Rename(_HF + "intermediate.dense.{kind}", _SMP + "output.dense1.{kind}"),
    Rename(_HF + "output.dense.{kind}", _SMP + "output.dense2.{kind}"),
    Rename(_HF + "output.LayerNorm.{kind}", _SMP + "output.layernorm.{kind}"),
)
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new",
               "relu": "relu"}


def translate_hf_state_dict_to_smdistributed_bert(state_dict: dict[str, Any]
                                                  ) -> dict[str, Any]:
    """A BERT state dict with its encoder in ``BertTransformer``'s (SMP's) names."""
    return hf_to_smp(state_dict, RULES, "BERT", passthrough=True)


def translate_state_dict_to_hf_bert(state_dict: dict[str, Any],
                                    max_seq_len: int | None = None) -> dict[str, Any]:
    """A state dict with an SMP BERT encoder in Hugging Face's names (``max_seq_len``:
    SMP's signature; BERT has no buffer it sizes)."""
    return smp_to_hf(state_dict, RULES, "BERT", passthrough=True)


def init_kwargs(config: Any) -> dict[str, Any]:
    """``DistributedTransformer``'s arguments for a ``BertConfig`` / ``RobertaConfig``
    (SMP's mapping); what the replacement cannot compute exactly is refused."""
    if config.hidden_size % config.num_attention_heads:
        raise SMPConfigError.build("hidden_size must be divisible by num_attention_heads",
                                   (config.hidden_size, config.num_attention_heads),
                                   "BertEncoder -> DistributedTransformer",
                                   "use a head count that divides the width")
    for field, bad in (("is_decoder", True), ("add_cross_attention", True)):
        if bool(getattr(config, field, False)) == bad:
            raise not_implemented(f"{type(config).__name__}.{field}=True in the distributed "
                                  "encoder", field, f"set {field}=False, or create the "
                                  "model outside smp.model_creation(tensor_parallelism=True)")
    position = getattr(config, "position_embedding_type", "absolute")
    if position != "absolute":
        raise not_implemented(f"position_embedding_type={position!r} in the distributed "
                              "encoder", "position_embedding_type", "use 'absolute'")
    if config.hidden_act not in ACTIVATIONS:
        raise not_implemented(f"activation {config.hidden_act!r} in the distributed encoder",
                              "hidden_act", f"use one of {sorted(ACTIVATIONS)}")
    return {"num_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "attention_head_size": config.hidden_size // config.num_attention_heads,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "attention_dropout_prob": config.attention_probs_dropout_prob,
            "hidden_dropout_prob": config.hidden_dropout_prob,
            "activation": ACTIVATIONS[config.hidden_act],
            "layernorm_epsilon": config.layer_norm_eps,
            "initializer_range": config.initializer_range,
            "use_normal_initialization": True, "pre_layernorm": False,
            "post_layernorm": True}


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The model's prepared mask as the layers' additive one: a boolean mask keeps its
    ``True`` positions; a floating one is additive already (0 or a large negative)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return (~mask).to(dtype) * MASKED
    return mask.to(dtype)


class BertTransformer(DistributedTransformer):
    """``BertEncoder`` as SMP replaces it (module docstring). ``config`` is the model's
    configuration."""

    def __init__(self, config: Any, **overrides: Any) -> None:
        super().__init__(**{**init_kwargs(config), **overrides})
        self.config = config

    # BertEncoder's arguments, not the transformer's tuple: it is called where the Hugging
    # Face encoder was
    def forward(self, hidden_states: torch.Tensor,  # type: ignore[override]
                attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: Any = None, encoder_attention_mask: Any = None,
                cache: Any = None, use_cache: bool | None = None, position_ids: Any = None,
                past_key_values: Any = None, head_mask: Any = None,
                output_attentions: bool | None = None,
                output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

        for name, value in {"encoder_hidden_states": encoder_hidden_states,
                            "encoder_attention_mask": encoder_attention_mask,
                            "cache": cache, "past_key_values": past_key_values,
                            "use_cache": use_cache, "output_attentions": output_attentions,
                            "output_hidden_states": output_hidden_states, **kwargs}.items():
            if not (value is None or value is False):
                raise not_implemented(f"{name} in the distributed encoder", name,
                                      f"leave {name} unset")
        if head_mask is not None and any(m is not None for m in head_mask):
            raise not_implemented("head_mask in the distributed encoder", "head_mask",
                                  "leave head_mask unset")
        mask = additive_mask(attention_mask, hidden_states.dtype)
        hidden = super().forward((hidden_states, mask))[0]
        out = BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden)
        return out.to_tuple() if return_dict is False else out  # as BertEncoder's

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "layer":
                raise AttributeError(
                    "'layer' is a BertEncoder attribute; the encoder was replaced by SMP's "
                    "DistributedTransformer (created for tensor parallelism): its layers "
                    "are seq_layers") from None
            raise


def encoder_to_smp(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The replaced encoder's own state dict (names relative to it) in SMP's names."""
    whole = translate_hf_state_dict_to_smdistributed_bert(
        {f"encoder.{k}": v for k, v in state_dict.items()})
    return {k[len("encoder."):]: v for k, v in whole.items()}


def build(original: nn.Module, overrides: dict[str, Any]) -> nn.Module:
    """The replacement of ``original`` (a ``BertEncoder``), holding its weights."""
    kwargs = registry.init_overrides(DistributedTransformer, overrides)
    return registry.rebuild(original, BertTransformer(original.config, **kwargs),
                            encoder_to_smp)


registry.register(registry.Replacement(
    HF_CLASS, build, (translate_state_dict_to_hf_bert,
                      translate_hf_state_dict_to_smdistributed_bert)))

__all__ = ["BertTransformer", "translate_hf_state_dict_to_smdistributed_bert",
           "translate_state_dict_to_hf_bert"]
