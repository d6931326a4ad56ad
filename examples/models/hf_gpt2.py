"""Hugging Face ``GPT2LMHeadModel`` from a tiny config (no download), wrapped to take
positional ``input_ids`` and return logits, so it follows the example-model convention."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 128
SEQ = 16


class GPT2Logits(nn.Module):
    """Thin wrapper: ``forward(input_ids) -> logits``; the HF model stays untouched."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def build_model(n_layer: int = 2, n_embd: int = 32, n_head: int = 4,
                n_positions: int = SEQ) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,  # inside the tiny vocab
                     attn_implementation="eager")
    return GPT2Logits(GPT2LMHeadModel(cfg)).eval()


def example_inputs(batch_size: int = 2) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())
