"""``smp.nn.huggingface.gptneo``: SMP's GPT-Neo translate functions, by name; refused when
called (``smp_fx.nn.huggingface.unbuilt`` says why and what runs instead)."""

from __future__ import annotations

from smp_fx.nn.huggingface.unbuilt import refusing

translate_hf_state_dict_to_smdistributed_gptneo = refusing(
    "translate_hf_state_dict_to_smdistributed_gptneo", "GPT-Neo", "gptneo")
translate_state_dict_to_hf_gptneo = refusing(
    "translate_state_dict_to_hf_gptneo", "GPT-Neo", "gptneo")

__all__ = ["translate_hf_state_dict_to_smdistributed_gptneo",
           "translate_state_dict_to_hf_gptneo"]
