"""SMP's per-layer hook functions (GPT-2's, GPT-J's): importable as AWS's scripts import
them, refused when called with the paths that are built."""

from __future__ import annotations

import pytest

import smp_fx as smp
from smp_fx.nn.huggingface import gpt2, gptj


@pytest.mark.parametrize("fn", [gpt2.get_hf_gpt2_transformer_layer_hooks,
                                gptj.get_hf_gptj_transformer_hooks])
def test_layer_hooks_name_the_built_paths(fn: object) -> None:
    assert callable(fn)
    with pytest.raises(smp.SMPNotImplementedError, match="model_creation"):
        fn()
    assert fn.__name__.startswith("get_hf_")  # type: ignore[attr-defined]
