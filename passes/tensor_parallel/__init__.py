"""Tensor parallelism as graph passes: marked regions of a traced model rewritten per rank.

The entry point is ``tensor_parallel`` (``rewrite.py``), taking ``TensorParallelism`` and
giving ``TensorParallelPlan``. See docs/tensor_parallel.md, 'The rewrite', and
docs/modules.md for its modules.
"""

from passes.tensor_parallel.plan import ShardSpec, TensorParallelPlan, merge_shards
from passes.tensor_parallel.rewrite import TensorParallelism, tensor_parallel

__all__ = ["ShardSpec", "TensorParallelPlan", "TensorParallelism", "merge_shards",
           "tensor_parallel"]
