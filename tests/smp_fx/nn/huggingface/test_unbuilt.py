"""SMP's GPT-J / GPT-Neo functions and GPT-2's per-layer hooks: importable as AWS's scripts
import them, refused when called with the fix."""

from __future__ import annotations

import pytest

import smp_fx as smp
from smp_fx.nn.huggingface import gpt2, gptj, gptneo


@pytest.mark.parametrize("fn", [
    gptj.translate_hf_state_dict_to_smdistributed_gptj,
    gptj.translate_hf_gptj_state_dict_to_smdistributed, gptj.translate_state_dict_to_hf_gptj,
    gptj.get_hf_gptj_transformer_hooks, gptneo.translate_hf_state_dict_to_smdistributed_gptneo,
    gptneo.translate_state_dict_to_hf_gptneo])
def test_gptj_gptneo_functions_refuse_with_the_fix(fn: object) -> None:
    assert callable(fn)
    with pytest.raises(smp.SMPNotImplementedError, match="keeps its parameter names"):
        fn({})


def test_gpt2_layer_hooks_name_the_built_paths() -> None:
    with pytest.raises(smp.SMPNotImplementedError, match="model_creation"):
        gpt2.get_hf_gpt2_transformer_layer_hooks()
    assert gpt2.get_hf_gpt2_transformer_layer_hooks.__name__ == \
        "get_hf_gpt2_transformer_layer_hooks"
