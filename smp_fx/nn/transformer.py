"""``smp.nn.DistributedTransformerLayer``, ``DistributedTransformer`` and
``DistributedTransformerLMHead``: SMP's tensor-parallel transformer, as plain torch modules.

Marked for tensor parallelism by construction. The LM head shifts the labels rather than
slicing the logits, so the logits reach ``F.cross_entropy`` through a flatten alone and the
rewrite fuses the vocab-parallel loss. As a model's root, a tuple argument is opaque to fx:
give the model a ``forward`` that builds it. See docs/tensor_parallel.md, 'API'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from cost_model.errors import SMPConfigError, SMPTracingError, not_implemented
from smp_fx.marking.tensor_parallelism import mark
from smp_fx.nn.attention import (
    MASKED,
    DistributedAttentionLayer,
    DistributedTransformerOutputLayer,
)

Pair = tuple[Any, ...]
IGNORE_INDEX = -100
"""The label ``F.cross_entropy`` ignores: padding, and the shifted-out last position."""


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: ``logits[:, i]`` against ``labels[:, i + 1]``, the mean
    over the targets not ignored. Shifting the labels (the last target ``IGNORE_INDEX``)
    equals slicing both (Hugging Face's GPT-2) and keeps the logits' path to the loss a
    reshape, which ``passes.tensor_parallel.loss`` fuses under tp."""
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], 1)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX)


def refuse_alibi(use_alibi: bool, where: str) -> None:
    """SMP 1.15's ``use_alibi`` (ALiBi attention biases, with ``alibi_bias_max`` the base of
    the head slopes) is not built: the biases depend on each head's global index, which
    the tensor-parallel rewrite's split of the heads would have to carry. An error where
    the module is created; ``alibi_bias_max`` alone is accepted (unused without ALiBi)."""
    if use_alibi:
        raise not_implemented("ALiBi attention biases", f"{where}(use_alibi=True)",
                              "leave use_alibi False (the model's position embeddings "
                              "give the positions)")


class DistributedTransformerLayer(nn.Module):
    """``DistributedAttentionLayer`` then ``DistributedTransformerOutputLayer`` (with
    ``add_cross_attention`` a cross attention between them); tuples in and out, so layers
    chain."""

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, *,
                 scale_attention_scores: bool = True, fp32_residual_addition: bool = False,
                 use_alibi: bool = False, alibi_bias_max: int = 8,
                 parallel_attention_mlp: bool = False, shared_layernorm: bool = False,
                 **attention_options: Any) -> None:
        refuse_alibi(use_alibi, "DistributedTransformerLayer")
        if (parallel_attention_mlp or shared_layernorm) and (
                add_cross_attention or not pre_layernorm):
            raise SMPConfigError.build(
                "a parallel attention and MLP takes pre layer norms and no cross attention",
                {"pre_layernorm": pre_layernorm, "add_cross_attention": add_cross_attention},
                "DistributedTransformerLayer(parallel_attention_mlp=True)",
                "set pre_layernorm=True and add_cross_attention=False")
        super().__init__()
        self.parallel_attention_mlp = parallel_attention_mlp or shared_layernorm
        self.shared_layernorm = shared_layernorm
        # SMP's layout: with both layer norms the sublayers before the MLP keep only their
        # pre layer norm, and the MLP's post layer norm normalises the layer's output
        inner_post = post_layernorm and not pre_layernorm
        self.attention = DistributedAttentionLayer(
            num_attention_heads, attention_head_size, hidden_size, attention_dropout_prob,
            hidden_dropout_prob, layernorm_epsilon, initializer_range,
            use_normal_initialization, causal_mask_size=causal_mask_size,
            pre_layernorm=pre_layernorm, post_layernorm=inner_post,
            scale_attention_scores=scale_attention_scores, **attention_options)
        self.crossattention = DistributedAttentionLayer(
            num_attention_heads, attention_head_size, hidden_size, attention_dropout_prob,
            hidden_dropout_prob, layernorm_epsilon, initializer_range,
            use_normal_initialization, cross_attention=True, pre_layernorm=pre_layernorm,
            post_layernorm=inner_post, scale_attention_scores=scale_attention_scores
        ) if add_cross_attention else None
        self.output = DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, hidden_dropout_prob, activation,
            layernorm_epsilon, initializer_range, use_normal_initialization,
            pre_layernorm=pre_layernorm and not shared_layernorm,
            post_layernorm=post_layernorm, fp32_residual_addition=fp32_residual_addition)
        mark(self)

    def forward(self, inputs: Pair) -> Pair:
        if self.parallel_attention_mlp:  # GPT-J / GPT-NeoX: x + attention(x) + mlp(x)
            hidden_states, attention_mask = inputs[0], inputs[1]
            attended = self.attention.attend((hidden_states, attention_mask))
            ln = self.attention.pre_layernorm
            mlp_in = ln(hidden_states) if self.shared_layernorm and ln is not None \
                else hidden_states
            out = attended + self.output.mlp(mlp_in) + hidden_states  # Hugging Face's order
            norm = self.output.layernorm
            return (out if norm is None else norm(out)), attention_mask
        if self.crossattention is None:
            hidden_states, attention_mask = inputs[0], inputs[1]
            attended = self.attention((hidden_states, attention_mask))
            return self.output(attended), attention_mask
        hidden_states, cross_states, attention_mask, cross_mask = inputs[:4]
        attended = self.attention((hidden_states, attention_mask))
        attended = self.crossattention((attended, cross_states, attention_mask, cross_mask))
        return self.output(attended), cross_states, attention_mask, cross_mask


class DistributedTransformer(nn.Module):
    """``num_layers`` ``DistributedTransformerLayer`` modules in sequence (``seq_layers``)."""

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, *,
                 scale_attention_scores: bool = True, fp32_residual_addition: bool = False,
                 use_alibi: bool = False, alibi_bias_max: int = 8,
                 layer_options: Sequence[dict[str, Any]] | None = None) -> None:
        refuse_alibi(use_alibi, "DistributedTransformer")
        super().__init__()
        self.num_layers = num_layers
        self.add_cross_attention = add_cross_attention
        # SMP's layout: with both layer norms only the last layer has the post layer norm
        # (the transformer's output is normalised once; GPT-2's ln_f)
        self.seq_layers = nn.Sequential(*[DistributedTransformerLayer(
            num_attention_heads, attention_head_size, hidden_size, intermediate_size,
            attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon,
            initializer_range, use_normal_initialization, causal_mask_size,
            add_cross_attention, pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm and (not pre_layernorm or i == num_layers - 1),
            scale_attention_scores=scale_attention_scores,
            fp32_residual_addition=fp32_residual_addition, alibi_bias_max=alibi_bias_max,
            **(layer_options[i] if layer_options else {}))
            for i in range(num_layers)])
        mark(self)

    def forward(self, inputs: Pair) -> Pair:
        out: Pair = tuple(inputs[:4] if self.add_cross_attention else inputs[:2])
        for layer in self.seq_layers:
            out = layer(out)
        return out


class _TableLookup(nn.Embedding):
    """An embedding table read by indexing: the rewrite's vocabulary split takes
    ``nn.Embedding`` / ``F.embedding`` lookups, and these small tables stay whole."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class DistributedTransformerLMHead(nn.Module):
    """Embeddings, a ``DistributedTransformer`` and an LM head tied to the word embedding;
    logits, or the loss when ``labels`` is given."""

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32,
                 attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, vocab_size: int = 30522,
                 num_positions: int = 1024, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True,
                 num_token_types: int = 0, add_lm_head: bool = True, *,
                 scale_attention_scores: bool = True, fp32_residual_addition: bool = False,
                 use_alibi: bool = False, alibi_bias_max: int = 8,
                 layer_options: Sequence[dict[str, Any]] | None = None) -> None:
        refuse_alibi(use_alibi, "DistributedTransformerLMHead")
        super().__init__()
        self.add_cross_attention = add_cross_attention
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
            causal_mask_size, add_cross_attention, pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm, scale_attention_scores=scale_attention_scores,
            fp32_residual_addition=fp32_residual_addition, alibi_bias_max=alibi_bias_max,
            layer_options=layer_options)
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
        items = [inputs[i] if i < len(inputs) else None
                 for i in range(1, 7 if self.add_cross_attention else 5)]
        attention_mask, token_type_ids, position_ids = items[:3]
        cross_states, cross_mask = items[3:5] if self.add_cross_attention else (None, None)
        labels = items[-1]
        x = self.embed(input_ids, token_type_ids, position_ids)
        hidden = self.body(x, attention_mask, cross_states, cross_mask)
        if self.lm_head is None:
            if labels is not None:
                raise SMPConfigError.build(
                    "labels need the LM head's logits", None,
                    "DistributedTransformerLMHead.forward",
                    "build it with add_lm_head=True, or leave labels out")
            return hidden
        logits = self.lm_head(hidden)
        return logits if labels is None else lm_loss(logits, labels)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Word + position (+ token type) embeddings, before dropout. Without a token-type
        table, token types are looked up in the word embedding (SMP's, as Hugging Face's
        GPT-2 does); positions default to ``0 .. S-1``."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embedding(input_ids) + self.position_embedding(position_ids)
        if token_type_ids is not None:
            table = self.token_type_embedding if self.token_type_embedding is not None \
                else self.word_embedding
            x = x + table(token_type_ids)
        return x

    def body(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
             cross_states: torch.Tensor | None = None,
             cross_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Dropout, the transformer and the final layer norm on embeddings ``x``; the
        masks are SMP's 0-1 ones (1 = masked)."""
        state: Pair = (self.dropout(x), _additive(attention_mask, x.dtype))
        if self.add_cross_attention:
            if cross_states is None:
                raise SMPConfigError.build(
                    "an LM head built with add_cross_attention=True needs cross_states",
                    None, "DistributedTransformerLMHead.forward",
                    "pass (input_ids, attention_mask, token_type_ids, position_ids, "
                    "cross_states, cross_mask, labels)")
            state = (state[0], cross_states, state[1], _additive(cross_mask, x.dtype))
        hidden: torch.Tensor = self.transformer(state)[0]
        return hidden if self.layernorm is None else self.layernorm(hidden)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """SMP's 0-1 ``[N, S]`` mask (1 = masked) as the layers' additive ``[N, 1, 1, S]``."""
    return None if mask is None else mask[:, None, None, :].to(dtype) * MASKED


__all__ = ["IGNORE_INDEX", "DistributedTransformer", "DistributedTransformerLMHead",
           "DistributedTransformerLayer", "lm_loss"]
