"""Tensor parallelism as graph passes: marked regions of a traced model rewritten per rank.

The entry point is ``tensor_parallel`` (``rewrite.py``); its inputs and outputs are
``TensorParallelism`` and ``TensorParallelPlan``. The modules, in the order the rewrite
uses them: ``linears`` (which linears shard, in which layout), ``propagation`` (a split
value and the edits the rules collect), ``rules`` (the table from op targets to sharding
rules; the op families in ``ops``, the shape ops' rules in ``reshapes``), ``sweep`` (each
linear's role in a region), ``vocab`` and ``loss`` (vocabulary-parallel embeddings, LM
heads and cross entropy), ``sequence`` (``optimize: "memory"``: activations chunked by
sequence), ``graph`` (editing a rank's graph), ``collectives`` (the autograd collectives
the rewritten graphs call), ``costs`` (one rank's costs) and ``plan`` (shard specs and
the plan). docs/tensor_parallel.md says what is sharded and why.
"""

from passes.tensor_parallel.plan import ShardSpec, TensorParallelPlan, merge_shards
from passes.tensor_parallel.rewrite import TensorParallelism, tensor_parallel

__all__ = ["ShardSpec", "TensorParallelPlan", "TensorParallelism", "merge_shards",
           "tensor_parallel"]
