"""``smp.nn.huggingface.roberta``: RoBERTa's encoder is BERT's, layer for layer, so it is
replaced by the same ``BertTransformer`` with the same name rules.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from smp_fx.nn.huggingface import bert, registry
from smp_fx.nn.huggingface.translate import hf_to_smp, smp_to_hf
from smp_fx.nn.transformer import DistributedTransformer

HF_CLASS = "transformers.models.roberta.modeling_roberta.RobertaEncoder"


def translate_hf_state_dict_to_smdistributed_roberta(state_dict: dict[str, Any]
                                                     ) -> dict[str, Any]:
    """A RoBERTa state dict with its encoder in SMP's names."""
    return hf_to_smp(state_dict, bert.RULES, "RoBERTa", passthrough=True)


def translate_state_dict_to_hf_roberta(state_dict: dict[str, Any],
                                       max_seq_len: int | None = None) -> dict[str, Any]:
    """A state dict with an SMP RoBERTa encoder in Hugging Face's names (``max_seq_len``:
    SMP's signature, unused)."""
    return smp_to_hf(state_dict, bert.RULES, "RoBERTa", passthrough=True)


def build(original: nn.Module, overrides: dict[str, Any]) -> nn.Module:
    """The replacement of ``original`` (a ``RobertaEncoder``), holding its weights."""
    kwargs = registry.init_overrides(DistributedTransformer, overrides)
    return registry.rebuild(original, bert.BertTransformer(original.config, **kwargs),
                            bert.encoder_to_smp)


registry.register(registry.Replacement(
    HF_CLASS, build, (translate_state_dict_to_hf_roberta,
                      translate_hf_state_dict_to_smdistributed_roberta)))

__all__ = ["translate_hf_state_dict_to_smdistributed_roberta",
           "translate_state_dict_to_hf_roberta"]
