"""``smp.model_creation``: SMP's one context for creating a model, combining
``smp.tensor_parallelism`` and ``smp.delay_param_initialization`` with a creation dtype.

SMP's kernel switches are accepted (same function); ``attention_in_fp32`` under half
training is not built; any other keyword is an error naming it.

>>> import smp_fx as smp, torch
>>> with smp.model_creation(tensor_parallelism=True, dtype=torch.float64):
...     layer = torch.nn.Linear(2, 2)
>>> layer.weight.dtype
torch.float64
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from cost_model.errors import SMPConfigError, not_implemented
from smp_fx.marking.delayed_init import delay_param_initialization
from smp_fx.marking.tensor_parallelism import tensor_parallelism as tp_context
from smp_fx.world import state

KERNEL_SWITCHES = frozenset({"fused_softmax", "fused_bias_gelu", "fused_dropout",
                             "query_key_layer_scaling", "attention_in_fp32", "flash_attention",
                             "distribute_embedding", "zero_init"})
"""SMP's keywords that choose kernels, precision tricks or SMP's own bookkeeping, not the
function computed: ``flash_attention`` (SMP 1.13+: its FlashAttention kernel for the same
attention), ``distribute_embedding`` (SMP splits the embedding over tp under sharded data
parallelism; smp-fx's tensor-parallel rewrite splits it by vocabulary rows regardless) and
``zero_init`` (SMP's initialisation of the replaced modules' weights for its sharded
data-parallel offsets; a replacement here takes the original model's weights, so nothing
depends on it)."""

MODULE_ARGUMENTS = frozenset({
    "num_layers", "num_attention_heads", "attention_head_size", "hidden_size",
    "intermediate_size", "vocab_size", "num_positions", "attention_dropout_prob",
    "hidden_dropout_prob", "activation", "layernorm_epsilon", "num_token_types",
    "causal_mask_size", "add_cross_attention", "add_lm_head", "initializer_range",
    "use_normal_initialization", "pre_layernorm", "post_layernorm", "scale_attention_scores",
    "fp32_residual_addition", "use_alibi", "alibi_bias_max"})
"""SMP's distributed-module arguments a keyword may override (``smp.nn``'s signatures)."""


def _check(tensor_parallel_config: dict[str, Any]) -> None:
    unknown = sorted(set(tensor_parallel_config) - KERNEL_SWITCHES - MODULE_ARGUMENTS)
    if unknown:
        raise SMPConfigError.build(
            "unknown tensor-parallel configuration keyword", unknown, "smp.model_creation",
            f"use the distributed modules' arguments or {sorted(KERNEL_SWITCHES)}")
    if tensor_parallel_config.get("attention_in_fp32") and state.is_initialized():
        cfg = state.get().config
        if cfg.fp16 or cfg.bf16 or cfg.fp16_params:
            raise not_implemented("attention_in_fp32 with fp16 / bf16 training",
                                  "attention_in_fp32", "leave attention_in_fp32 False")


@contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   **tensor_parallel_config: Any) -> Iterator[None]:
    """Create a model for SMP: tensor-parallel marking, delayed initialisation per the
    configuration, and ``dtype`` (module docstring)."""
    _check(tensor_parallel_config)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise SMPConfigError.build("dtype must be a floating-point torch.dtype or None",
                                   dtype, "smp.model_creation",
                                   "pass e.g. torch.float16, or leave it None")
    delayed = state.is_initialized() and state.get().config.delayed_parameter_initialization
    before = torch.get_default_dtype()
    marking = tp_context(bool(tensor_parallelism), **tensor_parallel_config)
    with marking, delay_param_initialization(enabled=delayed) if delayed else nullcontext():
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(before)


__all__ = ["KERNEL_SWITCHES", "MODULE_ARGUMENTS", "model_creation"]
