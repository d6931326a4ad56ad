"""Tiny Hugging Face mixture-of-experts models, each built from a config (no download), for
the expert-parallel tests and benchmark.

Four MoE families as transformers 5.x writes them: Mixtral (top-2 of softmax,
renormalised), Qwen3-MoE (``norm_topk_prob``), OLMoE (top-k of softmax, not renormalised)
and DeepSeek-V3 (sigmoid scores, grouped routing, a shared expert beside the routed ones).
Each has 2 layers of hidden size 32, 4 experts of which each token uses 2, vocabulary 64,
sequence 8; ``build(name)`` wraps it so ``forward(input_ids)`` returns the logits
(``hf_zoo.Logits``), in eval mode (no router jitter, no dropout); ``build(name, aux=True)``
returns ``(logits, aux_loss)``, the load-balancing loss Hugging Face computes from the
router logits (the families in ``AUX``; DeepSeek-V3 balances by a bias instead).

    model = build("olmoe")
    logits = model(*inputs(2))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from examples.models.hf_zoo import Logits

VOCAB, SEQ, HIDDEN, EXPERTS = 64, 8, 32, 4

_BASE = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
         "max_position_embeddings": 64, "num_experts_per_tok": 2}

ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {**_BASE, "num_local_experts": EXPERTS}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  {**_BASE, "num_experts": EXPERTS, "moe_intermediate_size": 24,
                   "head_dim": 8, "norm_topk_prob": True}),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig",
              {**_BASE, "num_experts": EXPERTS, "pad_token_id": 0, "eos_token_id": 1}),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    {**_BASE, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
                     "moe_intermediate_size": 24, "first_k_dense_replace": 0, "n_group": 2,
                     "topk_group": 1, "kv_lora_rank": 8, "q_lora_rank": 16,
                     "qk_rope_head_dim": 4, "v_head_dim": 8, "qk_nope_head_dim": 4,
                     "num_key_value_heads": 4}),
}
"""name -> (model class, config class, config arguments), names in ``transformers``."""


AUX = ("mixtral", "qwen3_moe", "olmoe")


class WithAux(nn.Module):
    """``forward(input_ids) -> (logits, aux_loss)`` over a Hugging Face MoE model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=input_ids)
        return out.logits, out.aux_loss


def config(name: str, **overrides: Any) -> Any:
    """The tiny config of ``name`` (eager attention), ``overrides`` applied."""
    import transformers

    _, cls, kwargs = ARCHITECTURES[name]
    cfg = getattr(transformers, cls)(**{**kwargs, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def build(name: str, seed: int = 0, aux: bool = False, **overrides: Any) -> nn.Module:
    """Architecture ``name`` from its tiny config (``overrides`` applied), weights drawn
    with ``seed``; with ``aux`` (a family in ``AUX``) it also returns the load-balancing
    loss."""
    import transformers

    cfg = config(name, **overrides)
    cfg.output_router_logits = aux
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[name][0])(cfg)
    return (WithAux(model) if aux else Logits(model, "lm")).eval()


def inputs(batch_size: int = 2) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def targets(batch_size: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def build_model(arch: str = "mixtral") -> nn.Module:
    """The example-model convention (``smp-fx partition examples/models/moe_zoo.py``)."""
    return build(arch)


def example_inputs(batch_size: int = 2) -> tuple[torch.Tensor]:
    return inputs(batch_size)
