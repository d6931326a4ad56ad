"""Context-parallel attention: this rank's queries against the whole sequence's keys.

Keys and values are all-gathered over the cp group (as Llama 3's context parallelism
does: one gather per layer, no online softmax to merge), so each query row is computed
exactly as in one process. The mask the model built for the whole sequence keeps this
rank's query rows; ``is_causal`` becomes the mask of the local queries' global positions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from passes.context_parallel import collectives


def _rows(mask: torch.Tensor, length: int) -> torch.Tensor:
    """The local query rows of a whole-sequence mask (a broadcast row dim stays)."""
    if mask.dim() >= 2 and mask.shape[-2] == length and length > 1:
        return mask.index_select(-2, collectives.query_positions(length, mask.device))
    return mask


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """True where this rank's query (by global position) may read the key."""
    rows = collectives.query_positions(length, device)
    return rows[:, None] >= torch.arange(length, device=device)[None, :]


def cp_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
            is_causal: bool = False, *, scale: float | None = None,
            enable_gqa: bool = False, key_whole: bool = False,
            value_whole: bool = False) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` for the local queries of a split sequence
    (``key``/``value``: the local chunks, gathered here, or already whole: ``*_whole``,
    gathered before a grouped-query repeat; dim -2 is the sequence)."""
    if not collectives.active():
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                              is_causal, scale=scale, enable_gqa=enable_gqa)
    key = key if key_whole else collectives.cp_gather_kv(key, -2)
    value = value if value_whole else collectives.cp_gather_kv(value, -2)
    length = key.shape[-2]
    mask: Any = None if attn_mask is None else _rows(attn_mask, length)
    if is_causal:
        allowed = causal_mask(length, query.device)
        if mask is None:
            mask = allowed
        elif mask.dtype == torch.bool:
            mask = mask & allowed
        else:
            mask = mask.masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(query, key, value, mask, dropout_p, False,
                                          scale=scale, enable_gqa=enable_gqa)


__all__ = ["causal_mask", "cp_sdpa"]
