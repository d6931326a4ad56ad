"""Hugging Face ``LlamaForCausalLM`` from a tiny config (no download): grouped-query
attention (4 query heads sharing 2 key/value heads), SwiGLU MLP, RoPE and RMSNorm, wrapped
to take positional ``input_ids`` and return logits, following the example-model convention."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 128
SEQ = 16


class LlamaLogits(nn.Module):
    """Thin wrapper: ``forward(input_ids) -> logits``; the HF model stays untouched."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def build_model(num_hidden_layers: int = 2, hidden_size: int = 32,
                num_attention_heads: int = 4, num_key_value_heads: int = 2,
                seq_len: int = SEQ) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden_size,
                      intermediate_size=2 * hidden_size, num_hidden_layers=num_hidden_layers,
                      num_attention_heads=num_attention_heads,
                      num_key_value_heads=num_key_value_heads,
                      max_position_embeddings=max(SEQ * 4, seq_len),
                      bos_token_id=0, eos_token_id=1, pad_token_id=2,
                      attn_implementation="eager")
    return LlamaLogits(LlamaForCausalLM(cfg)).eval()


def example_inputs(batch_size: int = 2, seq_len: int = SEQ) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)


def example_targets(batch_size: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())
