"""``"checkpoint_attentions": true``: SMP's attention checkpointing inside its transformer.

Each ``DistributedAttentionLayer`` gets the ``attention_core`` strategy (selective
recomputation) unless a checkpointed module holds it already; numerics unchanged.
See docs/memory.md, 'Selective recomputation'.
"""

from __future__ import annotations

from torch import nn

from passes.partition_config import ATTENTION_CORE
from smp_fx.marking.activation_checkpointing import is_marked, set_activation_checkpointing
from smp_fx.nn.attention import DistributedAttentionLayer


def checkpoint_attentions(module: nn.Module) -> list[str]:
    """Mark the attention layers of ``module``; returns their paths.

    >>> from smp_fx.nn import DistributedTransformer
    >>> t = DistributedTransformer(num_layers=2, num_attention_heads=2, attention_head_size=2,
    ...                            hidden_size=4, intermediate_size=8)
    >>> checkpoint_attentions(t)
    ['seq_layers.0.attention', 'seq_layers.1.attention']
    """
    marked: list[str] = []
    covered: list[str] = []
    for path, mod in module.named_modules():
        if any(path == c or path.startswith(c + ".") for c in covered):
            continue
        if is_marked(mod):
            covered.append(path)
        elif isinstance(mod, DistributedAttentionLayer):
            set_activation_checkpointing(mod, strategy=ATTENTION_CORE)
            marked.append(path)
            covered.append(path)
    return marked


__all__ = ["checkpoint_attentions"]
