"""``smp.nn.DistributedAttentionLayer`` and ``smp.nn.DistributedTransformerOutputLayer``:
the two halves of SMP's transformer layer, as plain torch modules.

Written so the fx rewrite shards every linear: q/k/v column-parallel into ``dense``
row-parallel (an explicit head count the rewrite divides), the MLP a column -> row pair.
The mask is built for the sequence at hand (a trace cannot slice a stored buffer by a
symbolic length). See docs/tensor_parallel.md, 'API'.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from cost_model.errors import SMPConfigError, not_implemented
from smp_fx.marking.tensor_parallelism import mark
from smp_fx.nn import rotary

MASKED = -10000.0
"""The additive score of a masked position (exp() of it is 0 in fp32 and fp16)."""


def activation_module(activation: str) -> nn.Module:
    """SMP's activations: ``"gelu"`` (exact, erf) and ``"relu"``; and ``"gelu_new"``, the
    tanh approximation Hugging Face's GPT-2 uses, so that a replaced Hugging Face model
    computes its own function (``smp_fx.nn.huggingface``)."""
    if activation == "gelu":
        return nn.GELU()
    if activation == "gelu_new":
        return nn.GELU(approximate="tanh")
    if activation == "relu":
        return nn.ReLU()
    raise not_implemented(f"activation {activation!r}", "activation",
                          fix="use 'gelu' or 'relu' (SMP's two activations)")


def init_linear(linear: nn.Linear, normal: bool, std: float) -> None:
    """``use_normal_initialization``: weights ``N(0, initializer_range)``, biases 0;
    otherwise torch's default initialisation is kept."""
    if normal:
        with torch.no_grad():
            nn.init.normal_(linear.weight, std=std)
            if linear.bias is not None:
                linear.bias.zero_()


def causal_mask(positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[S, S]`` for the ``S`` positions given: 0 where a query may attend (key <= query,
    and with ``window`` key > query - window: GPT-Neo's local attention), ``MASKED``
    elsewhere. Built from the sequence at hand (a tensor op, so fx traces it with a
    symbolic ``S``)."""
    ahead = positions[None, :] - positions[:, None]
    masked = ahead > 0 if window is None else (ahead > 0) | (ahead <= -window)
    return masked.to(torch.float32) * MASKED


class DistributedAttentionLayer(nn.Module):
    """Multi-head self-attention (or, with ``cross_attention``, cross attention) with residual
    and layer norms, split by heads under tp; inputs as SMP's page orders them."""

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 cross_attention: bool = False, causal_mask_size: int | None = None,
                 pre_layernorm: bool = False, post_layernorm: bool = True, *,
                 scale_attention_scores: bool = True, rotary_dim: int = 0,
                 rotary_interleaved: bool = False, rotary_base: float = 10000.0,
                 window_size: int | None = None, query_key_value_bias: bool = True,
                 dense_bias: bool = True) -> None:
        if cross_attention and causal_mask_size is not None:
            raise SMPConfigError.build(
                "cross attention attends to another sequence, which has no causal order",
                causal_mask_size, "DistributedAttentionLayer(cross_attention=True)",
                "leave causal_mask_size None (the self attention holds the causal mask)")
        super().__init__()
        self.cross_attention = cross_attention
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = attention_head_size
        inner = num_attention_heads * attention_head_size
        self.query = nn.Linear(hidden_size, inner, bias=query_key_value_bias)
        self.key = nn.Linear(hidden_size, inner, bias=query_key_value_bias)
        self.value = nn.Linear(hidden_size, inner, bias=query_key_value_bias)
        self.dense = nn.Linear(inner, hidden_size, bias=dense_bias)
        for linear in (self.query, self.key, self.value, self.dense):
            init_linear(linear, use_normal_initialization, initializer_range)
        self.attention_dropout = nn.Dropout(attention_dropout_prob)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) \
            if pre_layernorm else None
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) \
            if post_layernorm else None
        self.causal_mask_size = causal_mask_size
        self.rotary_dim = rotary_dim
        self.rotary_interleaved = rotary_interleaved
        self.rotary_base = rotary_base
        self.window_size = window_size
        # SMP's scale_attention_scores: False leaves out the 1 / sqrt(d) of the scores
        self.score_scale = 1.0 / math.sqrt(attention_head_size) if scale_attention_scores \
            else 1.0
        mark(self)

    def _heads(self, x: torch.Tensor, b: Any, s: Any) -> torch.Tensor:
        """``[N, S, heads * d]`` -> ``[N, heads, S, d]`` (the head count stays explicit:
        the rewrite divides it by tp)."""
        return x.view(b, s, self.num_attention_heads, self.attention_head_size).transpose(1, 2)

    def forward(self, inputs: tuple[Any, ...]) -> torch.Tensor:
        out = self.attend(inputs) + inputs[0]
        return out if self.layernorm is None else self.layernorm(out)

    def attend(self, inputs: tuple[Any, ...]) -> torch.Tensor:
        """The attention's output alone (after ``dense`` and dropout, before the residual):
        a parallel layer adds it to the MLP's (GPT-J, GPT-NeoX)."""
        hidden_states = inputs[0]
        if self.cross_attention:  # (hidden_states, cross_states, attention_mask, cross_mask)
            source, attention_mask = inputs[1], inputs[3]
        else:
            source, attention_mask = None, inputs[1]
        x = hidden_states if self.pre_layernorm is None else self.pre_layernorm(hidden_states)
        kv = x if source is None else source
        b, s = x.shape[0], x.shape[1]
        q = self._heads(self.query(x), b, s)
        k = self._heads(self.key(kv), b, kv.shape[1])
        v = self._heads(self.value(kv), b, kv.shape[1])
        if self.rotary_dim:
            cos, sin = rotary.angles(torch.arange(s, device=x.device), self.rotary_dim,
                                     self.rotary_base, self.rotary_interleaved)
            q = rotary.apply(q, cos, sin, self.rotary_interleaved)
            k = rotary.apply(k, cos, sin, self.rotary_interleaved)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.score_scale
        if self.causal_mask_size is not None:
            causal = causal_mask(torch.arange(s, device=x.device), self.window_size)
            scores = scores + causal.to(x.dtype)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = self.attention_dropout(torch.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).contiguous()
        context = context.view(b, s, self.num_attention_heads * self.attention_head_size)
        out: torch.Tensor = self.dropout(self.dense(context))
        return out


class DistributedTransformerOutputLayer(nn.Module):
    """The transformer's MLP with residual and layer norms, a column -> row pair under tp;
    ``fp32_residual_addition`` is SMP's guard against fp16 overflow."""

    def __init__(self, hidden_size: int = 1024, intermediate_size: int = 4096,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu",
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False,
                 post_layernorm: bool = True, fp32_residual_addition: bool = False) -> None:
        act = activation_module(activation)
        super().__init__()
        self.dense1 = nn.Linear(hidden_size, intermediate_size)
        self.activation = act
        self.dense2 = nn.Linear(intermediate_size, hidden_size)
        for linear in (self.dense1, self.dense2):
            init_linear(linear, use_normal_initialization, initializer_range)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) \
            if pre_layernorm else None
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) \
            if post_layernorm else None
        self.fp32_residual_addition = fp32_residual_addition
        mark(self)

    def mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MLP's output alone (pre layer norm included): a parallel layer adds it to
        the attention's (GPT-J, GPT-NeoX)."""
        x = hidden_states if self.pre_layernorm is None else self.pre_layernorm(hidden_states)
        out: torch.Tensor = self.dropout(self.dense2(self.activation(self.dense1(x))))
        return out

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp(hidden_states)
        if self.fp32_residual_addition:  # SMP's overflow guard for half training
            out = (mlp.float() + hidden_states.float()).to(hidden_states.dtype)
        else:
            out = mlp + hidden_states
        return out if self.layernorm is None else self.layernorm(out)


__all__ = ["MASKED", "DistributedAttentionLayer", "DistributedTransformerOutputLayer",
           "activation_module", "causal_mask", "init_linear"]
