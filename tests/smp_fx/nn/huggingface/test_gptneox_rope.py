"""SMP's distributed GPT-NeoX refuses scaled rotary embeddings at wrapping, naming the
config key: its rotary embedding is the default one, and a scaled model would compute
something else without a word."""

from __future__ import annotations

import pytest
import torch

import smp_fx as smp
from tests.helpers.numerics import init
from tests.smp_fx.nn.huggingface.test_causal_families import config

transformers = pytest.importorskip("transformers")


def test_scaled_rotary_embeddings_are_refused_at_wrapping(one_thread: None) -> None:
    init(1, 1, "simple")
    cfg = config("gptneox")
    base = getattr(cfg, "rope_parameters", None) or {}  # transformers 5: one dict for both
    cfg.rope_scaling = {**base, "rope_type": "linear", "type": "linear", "factor": 2.0}
    with smp.model_creation(tensor_parallelism=True, dtype=torch.float32):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with pytest.raises(smp.SMPNotImplementedError, match="rope_scaling"):
            smp.DistributedModel(model)
