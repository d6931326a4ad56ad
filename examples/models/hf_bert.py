"""Hugging Face ``BertForMaskedLM`` from a tiny config (no download), wrapped to take
positional ``input_ids`` and return logits, so it follows the example-model convention."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 128
SEQ = 16


class BertLogits(nn.Module):
    """Thin wrapper: ``forward(input_ids) -> logits``; the HF model stays untouched."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def build_model(num_hidden_layers: int = 2, hidden_size: int = 32,
                num_attention_heads: int = 4, seq_len: int = SEQ) -> nn.Module:
    """``seq_len``: the longest sequence it takes (its position embeddings)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=hidden_size,
                     num_hidden_layers=num_hidden_layers,
                     num_attention_heads=num_attention_heads, intermediate_size=4 * hidden_size,
                     max_position_embeddings=max(SEQ, seq_len), hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return BertLogits(BertForMaskedLM(cfg)).eval()


def example_inputs(batch_size: int = 2) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())
