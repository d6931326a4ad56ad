"""``smp.nn.huggingface.gptneox``: Hugging Face's GPT-NeoX as SMP distributes it.

``GPTNeoXLMHead``: GPT-NeoX's layers (parallel residual optional), half-paired rotary
embeddings, its own LM head. q, k and v are fused per head, so translating needs the head
count. SMP had no public GPT-NeoX translate functions; these are named as its others are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from cost_model.errors import SMPCheckpointError, not_implemented
from smp_fx.nn.huggingface import registry
from smp_fx.nn.huggingface.causal_lm import CausalLMHead, Layout
from smp_fx.nn.huggingface.translate import Rename, hf_to_smp, smp_to_hf
from smp_fx.world.state_api import Translator

HF_CLASS = "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXForCausalLM"
FAMILY = "GPT-NeoX"
_H = "gpt_neox.layers.{layer}."
_L = "transformer.seq_layers.{layer}."
_QKV = re.compile(r"(gpt_neox\.layers\.\d+\.attention\.)query_key_value\.(weight|bias)$")
PARTS = ("query", "key", "value")
RULES = (
    Rename("gpt_neox.embed_in.weight", "word_embedding.weight"),
    Rename(_H + "input_layernorm.{kind}", _L + "attention.pre_layernorm.{kind}"),
    *(Rename(_H + f"attention.{p}.{{kind}}", _L + f"attention.{p}.{{kind}}") for p in PARTS),
    Rename(_H + "attention.dense.{kind}", _L + "attention.dense.{kind}"),
    Rename(_H + "post_attention_layernorm.{kind}", _L + "output.pre_layernorm.{kind}"),
    Rename(_H + "mlp.dense_h_to_4h.{kind}", _L + "output.dense1.{kind}"),
    Rename(_H + "mlp.dense_4h_to_h.{kind}", _L + "output.dense2.{kind}"),
    Rename("gpt_neox.final_layer_norm.{kind}",
           "transformer.seq_layers.{last}.output.layernorm.{kind}"),
)
HEADS = ("embed_out.weight", "lm_head.weight")
"""The LM head's Hugging Face names: transformers 4's, 5's."""
DROPPED = (_H + "attention.bias", _H + "attention.masked_bias",
           _H + "attention.rotary_emb.inv_freq", "gpt_neox.rotary_emb.inv_freq")


def _heads(num_attention_heads: int | None, where: str) -> int:
    if not num_attention_heads:
        raise SMPCheckpointError.build(
            "GPT-NeoX's query_key_value interleaves q, k and v per head: translating needs "
            "the head count", num_attention_heads, where,
            "pass num_attention_heads=config.num_attention_heads")
    return num_attention_heads


def translate_hf_state_dict_to_smdistributed_gptneox(
        state_dict: dict[str, Any], num_attention_heads: int | None = None) -> dict[str, Any]:
    """A ``GPTNeoXForCausalLM`` state dict in ``GPTNeoXLMHead``'s (SMP's) names."""
    heads = _heads(num_attention_heads, "translate_hf_state_dict_to_smdistributed_gptneox")
    split: dict[str, Any] = {}
    for key, value in state_dict.items():
        found = _QKV.match(key)
        if found is None:
            split[key] = value
            continue
        per_head = value.reshape(heads, 3, -1, *value.shape[1:])
        for i, part in enumerate(PARTS):
            split[f"{found[1]}{part}.{found[2]}"] = \
                per_head[:, i].reshape(-1, *value.shape[1:])
    rules = RULES + tuple(Rename(h, "lm_head.weight") for h in HEADS)
    return hf_to_smp(split, rules, FAMILY, "gpt_neox.layers", DROPPED)


def translate_state_dict_to_hf_gptneox(state_dict: dict[str, Any],
                                       num_attention_heads: int | None = None
                                       ) -> dict[str, Any]:
    """A ``GPTNeoXLMHead`` (SMP) state dict in ``GPTNeoXForCausalLM``'s names."""
    heads = _heads(num_attention_heads, "translate_state_dict_to_hf_gptneox")
    import transformers

    head = HEADS[int(transformers.__version__.split(".")[0]) >= 5]
    out = smp_to_hf(state_dict, RULES + (Rename(head, "lm_head.weight"),), FAMILY,
                    "transformer.seq_layers")
    fused = re.compile(r"(gpt_neox\.layers\.\d+\.attention\.)query\.(weight|bias)$")
    for key in [k for k in out if fused.match(k)]:
        found = fused.match(key)
        assert found is not None
        names = [f"{found[1]}{p}.{found[2]}" for p in PARTS]
        parts = [out.pop(n) for n in names]
        stacked = torch.stack([p.reshape(heads, -1, *p.shape[1:]) for p in parts], dim=1)
        out[f"{found[1]}query_key_value.{found[2]}"] = \
            stacked.reshape(-1, *parts[0].shape[1:]).contiguous()
    return out


def translators(config: Any) -> tuple[Translator, Translator]:
    """The pair for ``smp.state.module_manager``, bound to ``config``'s head count."""
    heads = config.num_attention_heads
    to_hf: Callable[[dict[str, Any]], dict[str, Any]] = \
        lambda sd: translate_state_dict_to_hf_gptneox(sd, heads)  # noqa: E731
    to_smp: Callable[[dict[str, Any]], dict[str, Any]] = \
        lambda sd: translate_hf_state_dict_to_smdistributed_gptneox(sd, heads)  # noqa: E731
    return to_hf, to_smp


def _rope(config: Any) -> tuple[float, float]:
    """(base, share of the head rotated): transformers 5's ``rope_parameters`` or 4.x's
    ``rotary_emb_base`` / ``rotary_pct``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = params.get("rope_type", "default") != "default" if params else \
        getattr(config, "rope_scaling", None)
    if scaling:
        raise not_implemented("scaled rotary embeddings in the distributed GPT-NeoX",
                              "GPTNeoXConfig.rope_scaling", "use the default rope type")
    return (float(params.get("rope_theta", getattr(config, "rotary_emb_base", 10000))),
            float(params.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0))))


def layout(config: Any) -> Layout:
    """``GPTNeoXLMHead``'s arguments for a ``GPTNeoXConfig``."""
    if config.hidden_act not in ("gelu", "relu", "gelu_new"):
        raise not_implemented(f"activation {config.hidden_act!r} in the distributed "
                              "GPT-NeoX", "GPTNeoXConfig.hidden_act",
                              "use 'gelu' (GPT-NeoX's), 'gelu_new' or 'relu'")
    head = config.hidden_size // config.num_attention_heads
    base, share = _rope(config)
    kwargs = {"num_layers": config.num_hidden_layers,
              "num_attention_heads": config.num_attention_heads,
              "attention_head_size": head, "hidden_size": config.hidden_size,
              "intermediate_size": config.intermediate_size,
              "vocab_size": config.vocab_size,
              "num_positions": config.max_position_embeddings,
              "attention_dropout_prob": config.attention_dropout,
              "hidden_dropout_prob": config.hidden_dropout, "activation": config.hidden_act,
              "layernorm_epsilon": config.layer_norm_eps,
              "initializer_range": config.initializer_range,
              "use_normal_initialization": True,
              "causal_mask_size": config.max_position_embeddings,
              "pre_layernorm": True, "post_layernorm": True}
    bias = bool(getattr(config, "attention_bias", True))
    options = {"parallel_attention_mlp": bool(config.use_parallel_residual),
               "rotary_dim": int(head * share), "rotary_base": base,
               "query_key_value_bias": bias, "dense_bias": bias}
    return Layout(kwargs, [options] * config.num_hidden_layers, positions=False,
                  tied=bool(getattr(config, "tie_word_embeddings", False)),
                  embedding_dropout=config.hidden_dropout)


class GPTNeoXLMHead(CausalLMHead):
    """``GPTNeoXForCausalLM`` as SMP replaces it (module docstring)."""

    family = FAMILY

    def __init__(self, config: Any, **overrides: Any) -> None:
        super().__init__(config, layout(config), **overrides)


registry.register_lm(HF_CLASS, GPTNeoXLMHead, (translate_state_dict_to_hf_gptneox,
                                               translate_hf_state_dict_to_smdistributed_gptneox),
                     translators)

__all__ = ["GPTNeoXLMHead", "translate_hf_state_dict_to_smdistributed_gptneox",
           "translate_state_dict_to_hf_gptneox"]
