"""``smp.nn.DistributedEmbedding``: an embedding that tensor parallelism distributes.

SMP documents a split along the embedding dimension; smp-fx splits rows (same function and
output), which keeps a tied LM head on the same shard. See docs/tensor_parallel.md, 'API'.
"""

from __future__ import annotations

import torch
from torch import nn

from cost_model.errors import not_implemented
from smp_fx.marking.tensor_parallelism import mark


class DistributedEmbedding(nn.Embedding):
    """``nn.Embedding`` distributed over the tp group by vocabulary rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: torch.Tensor | None = None, initializer_range: float = 0.02,
                 _skip_allgather: bool = False, _skip_scatter_and_merge: bool = False) -> None:
        if _skip_allgather or _skip_scatter_and_merge:
            raise not_implemented("DistributedEmbedding(_skip_allgather / "
                                  "_skip_scatter_and_merge=True): an output left split",
                                  fix="leave both False (the output is replicated)")
        super().__init__(num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
                         scale_grad_by_freq, sparse, _weight)
        if _weight is None:
            with torch.no_grad():
                nn.init.normal_(self.weight, std=initializer_range)
                if padding_idx is not None:
                    self.weight[padding_idx].zero_()
        mark(self)
