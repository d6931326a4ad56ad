"""``smp.nn.huggingface.gptj``: SMP's GPT-J translate and hook functions, by name; refused
when called (``smp_fx.nn.huggingface.unbuilt`` says why and what runs instead).
``translate_hf_gptj_state_dict_to_smdistributed`` is the spelling AWS's GPT-J script imports
besides SMP's ``translate_hf_state_dict_to_smdistributed_gptj``."""

from __future__ import annotations

from smp_fx.nn.huggingface.unbuilt import refusing

translate_hf_state_dict_to_smdistributed_gptj = refusing(
    "translate_hf_state_dict_to_smdistributed_gptj", "GPT-J", "gptj")
translate_hf_gptj_state_dict_to_smdistributed = refusing(
    "translate_hf_gptj_state_dict_to_smdistributed", "GPT-J", "gptj")
translate_state_dict_to_hf_gptj = refusing("translate_state_dict_to_hf_gptj", "GPT-J", "gptj")
get_hf_gptj_transformer_hooks = refusing("get_hf_gptj_transformer_hooks", "GPT-J", "gptj")

__all__ = ["get_hf_gptj_transformer_hooks", "translate_hf_gptj_state_dict_to_smdistributed",
           "translate_hf_state_dict_to_smdistributed_gptj", "translate_state_dict_to_hf_gptj"]
