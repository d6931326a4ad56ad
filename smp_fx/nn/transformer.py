"""``smp.nn.DistributedTransformerLayer``, ``DistributedTransformer`` and
``DistributedTransformerLMHead``: SMP's tensor-parallel transformer, as plain torch modules.

Each is marked for tensor parallelism by construction; a model that holds one is traced by
the fx front end and the rewrite (``passes.tensor_parallel``) splits every attention by
heads and every MLP as a column -> row pair (``smp_fx.nn.attention``), and the LM head's
word embedding and the tied output projection by vocabulary rows (``passes.tp_vocab``).

Inputs and outputs follow SMP: the layer and the transformer take a tuple
``(hidden_states, attention_mask)`` and return one, so layers chain; ``attention_mask`` is
additive (``[N, 1, 1, S]``, ``-10000`` where masked) or None. The LM head takes the tuple
``(input_ids, attention_mask, token_type_ids, position_ids)`` (trailing items may be left
out); its ``attention_mask`` is SMP's 0-1 ``[N, S]`` tensor where **1 marks a masked
position** (padding), turned into the additive form inside. It returns the logits
``[N, S, vocab_size]`` (``add_lm_head``) or the final hidden states; the loss is the
caller's (SMP's ``labels`` item is not built: a non-None one raises).

Where SMP's page is silent: with ``pre_layernorm`` and no ``post_layernorm`` (GPT-2's
layout) the LM head applies a final layer norm to the transformer's output (GPT-2's
``ln_f``), since the layers leave their sum un-normalised. The position and token-type
tables are small and stay whole on every rank (a replicated lookup), so only the word
embedding needs a vocabulary divisible by the degree.

Used as the root of a ``DistributedModel``, a tuple argument is one opaque input to fx
tracing (``SMPTracingError`` below; the ``auto`` front end then captures it with
``torch.export``, whose graph reads the tied weight under one name, so the rewrite leaves
the LM head replicated, saying why): give the model a ``forward`` that builds the tuple
(``None`` items then stay ``None`` while tracing), as
``tests/smp_fx/dist/test_tp_modules.py`` does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cost_model.errors import SMPConfigError, SMPTracingError, not_implemented
from smp_fx.nn.attention import (
    MASKED,
    DistributedAttentionLayer,
    DistributedTransformerOutputLayer,
)
from smp_fx.tp_marking import mark

Pair = tuple[torch.Tensor, Any]


def _no_cross_attention(add_cross_attention: bool, where: str) -> None:
    if add_cross_attention:
        raise not_implemented("cross attention over an encoder's states",
                              f"{where}(add_cross_attention=True)",
                              fix="use add_cross_attention=False (decoder/encoder only)")


class DistributedTransformerLayer(nn.Module):
    """``DistributedAttentionLayer`` then ``DistributedTransformerOutputLayer``.

    ``forward((hidden_states, attention_mask))`` -> ``(hidden_states, attention_mask)``.
    """

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True) -> None:
        _no_cross_attention(add_cross_attention, "DistributedTransformerLayer")
        super().__init__()
        self.attention = DistributedAttentionLayer(
            num_attention_heads, attention_head_size, hidden_size, attention_dropout_prob,
            hidden_dropout_prob, layernorm_epsilon, initializer_range,
            use_normal_initialization, causal_mask_size=causal_mask_size,
            pre_layernorm=pre_layernorm, post_layernorm=post_layernorm)
        self.output = DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, hidden_dropout_prob, activation,
            layernorm_epsilon, initializer_range, use_normal_initialization,
            pre_layernorm=pre_layernorm, post_layernorm=post_layernorm)
        mark(self)

    def forward(self, inputs: Pair) -> Pair:
        hidden_states, attention_mask = inputs[0], inputs[1]
        attended = self.attention((hidden_states, attention_mask))
        return self.output(attended), attention_mask


class DistributedTransformer(nn.Module):
    """``num_layers`` ``DistributedTransformerLayer``\\ s in sequence (``seq_layers``).

    ``forward((hidden_states, attention_mask))`` -> ``(hidden_states, attention_mask)``.
    """

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True) -> None:
        _no_cross_attention(add_cross_attention, "DistributedTransformer")
        super().__init__()
        self.num_layers = num_layers
        self.seq_layers = nn.ModuleList([DistributedTransformerLayer(
            num_attention_heads, attention_head_size, hidden_size, intermediate_size,
            attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon,
            initializer_range, use_normal_initialization, causal_mask_size,
            pre_layernorm=pre_layernorm, post_layernorm=post_layernorm)
            for _ in range(num_layers)])
        mark(self)

    def forward(self, inputs: Pair) -> Pair:
        out: Pair = (inputs[0], inputs[1])
        for layer in self.seq_layers:
            out = layer(out)
        return out


class _TableLookup(nn.Embedding):
    """An embedding table read by indexing: the rewrite's vocabulary split takes
    ``nn.Embedding`` / ``F.embedding`` lookups, and these small tables stay whole."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class DistributedTransformerLMHead(nn.Module):
    """Embeddings, a ``DistributedTransformer`` and an LM head tied to the word embedding.

    ``forward((input_ids, attention_mask, token_type_ids, position_ids))`` -> logits
    (module docstring for the items; None or left out: no mask, no token types,
    positions ``0 .. S-1``).
    """

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, vocab_size: int = 30522,
                 num_positions: int = 1024, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True,
                 num_token_types: int = 0, add_lm_head: bool = True) -> None:
        _no_cross_attention(add_cross_attention, "DistributedTransformerLMHead")
        super().__init__()
        self.word_embedding = nn.Embedding(vocab_size, hidden_size)
        self.position_embedding = _TableLookup(num_positions, hidden_size)
        self.token_type_embedding = _TableLookup(num_token_types, hidden_size) \
            if num_token_types > 0 else None
        for table in (self.word_embedding, self.position_embedding, self.token_type_embedding):
            if table is not None:
                nn.init.normal_(table.weight, std=initializer_range)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers, num_attention_heads, attention_head_size, hidden_size,
            intermediate_size, attention_dropout_prob, hidden_dropout_prob, activation,
            layernorm_epsilon, initializer_range, use_normal_initialization,
            causal_mask_size, pre_layernorm=pre_layernorm, post_layernorm=post_layernorm)
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) \
            if pre_layernorm and not post_layernorm else None
        self.lm_head: nn.Linear | None = None
        if add_lm_head:
            self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
            self.lm_head.weight = self.word_embedding.weight
        mark(self)

    def forward(self, inputs: tuple[Any, ...]) -> torch.Tensor:
        if not isinstance(inputs, (tuple, list)):  # an fx Proxy: the root's one input
            raise SMPTracingError.build(
                "DistributedTransformerLMHead takes a tuple whose items tracing must see",
                type(inputs).__name__, "DistributedTransformerLMHead.forward",
                "call it from a module whose forward builds the tuple "
                "(model((input_ids, attention_mask)) inside your own forward)")
        input_ids = inputs[0]
        attention_mask, token_type_ids, position_ids, labels = (
            inputs[i] if i < len(inputs) else None for i in range(1, 5))
        if labels is not None:
            raise not_implemented("a loss computed inside the LM head",
                                  "DistributedTransformerLMHead labels",
                                  fix="leave labels out and compute the loss on the logits")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embedding(input_ids) + self.position_embedding(position_ids)
        if token_type_ids is not None:
            if self.token_type_embedding is None:
                raise SMPConfigError.build(
                    "token_type_ids given to an LM head built with num_token_types=0",
                    None, "DistributedTransformerLMHead.forward",
                    "pass num_token_types > 0, or None as token_type_ids")
            x = x + self.token_type_embedding(token_type_ids)
        additive = None
        if attention_mask is not None:  # SMP's 0-1 mask, 1 = masked -> [N, 1, 1, S]
            additive = attention_mask[:, None, None, :].to(x.dtype) * MASKED
        hidden = self.transformer((self.dropout(x), additive))[0]
        if self.layernorm is not None:
            hidden = self.layernorm(hidden)
        return hidden if self.lm_head is None else self.lm_head(hidden)


__all__ = ["DistributedTransformer", "DistributedTransformerLMHead",
           "DistributedTransformerLayer"]
