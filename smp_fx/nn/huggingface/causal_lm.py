"""The part SMP's GPT-J, GPT-Neo and GPT-NeoX replacements share: a
``DistributedTransformerLMHead`` with per-layer options, called with the Hugging Face
model's arguments and returning its ``CausalLMOutputWithPast``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cost_model.errors import SMPConfigError, not_implemented
from smp_fx.nn.huggingface.gpt2 import refuse_arguments
from smp_fx.nn.transformer import DistributedTransformerLMHead, lm_loss


@dataclass(frozen=True)
class Layout:
    """What a family's model has beyond ``DistributedTransformerLMHead``'s arguments."""

    kwargs: dict[str, Any]
    layer_options: Sequence[dict[str, Any]] = field(default_factory=tuple)
    positions: bool = True
    tied: bool = True
    head_bias: bool = False
    embedding_dropout: float = 0.0


class CausalLMHead(DistributedTransformerLMHead):
    """A Hugging Face causal LM as SMP replaces it (module docstring)."""

    family = "causal LM"

    def __init__(self, config: Any, layout: Layout, **overrides: Any) -> None:
        super().__init__(**{**layout.kwargs, **overrides},
                         layer_options=layout.layer_options)
        self.config = config
        self.dropout = nn.Dropout(layout.embedding_dropout)
        if not layout.positions:  # rotary embeddings give the positions
            del self.position_embedding
            self.register_module("position_embedding", None)
        if not layout.tied:
            vocab, hidden = self.word_embedding.weight.shape
            self.lm_head = nn.Linear(hidden, vocab, bias=layout.head_bias)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.position_embedding is not None:
            return super().embed(input_ids, token_type_ids, position_ids)
        if token_type_ids is not None or position_ids is not None:
            raise not_implemented(f"token_type_ids / position_ids in the distributed "
                                  f"{self.family}", "token_type_ids, position_ids",
                                  "leave them unset (positions 0 .. S-1)")
        out: torch.Tensor = self.word_embedding(input_ids)
        return out

    # the Hugging Face model's arguments: the replacement is called as the model it replaces
    def forward(self, input_ids: torch.Tensor | None = None,  # type: ignore[override]
                past_key_values: Any = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, head_mask: Any = None,
                inputs_embeds: Any = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                cache_position: Any = None, logits_to_keep: int = 0) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        refuse_arguments(self.family, past_key_values=past_key_values, head_mask=head_mask,
                         inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_attentions=output_attentions,
                         output_hidden_states=output_hidden_states,
                         cache_position=cache_position, logits_to_keep=logits_to_keep)
        if input_ids is None:
            raise SMPConfigError.build(f"the distributed {self.family} needs input_ids", None,
                                       f"{type(self).__name__}.forward", "pass input_ids")
        # Hugging Face's mask keeps 1s and masks 0s; the LM head's masks the 1s
        padding = None if attention_mask is None else 1 - attention_mask
        hidden = self.body(self.embed(input_ids, token_type_ids, position_ids), padding)
        assert self.lm_head is not None
        logits = self.lm_head(hidden)
        loss = None if labels is None else lm_loss(logits, labels)
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


__all__ = ["CausalLMHead", "Layout"]
