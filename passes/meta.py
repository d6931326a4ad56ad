"""The ``node.meta`` keys smp-fx writes, declared once, with typed accessors.

Values are immutable because ``Graph.node_copy`` copies ``meta`` shallowly; torch's own
keys are read, never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch.fx

T = TypeVar("T")


@dataclass(frozen=True)
class MetaKey(Generic[T]):
    """A typed handle on one ``node.meta`` entry."""

    name: str
    doc: str

    def get(self, node: torch.fx.Node, default: Any = None) -> T:
        return node.meta.get(self.name, default)

    def has(self, node: torch.fx.Node) -> bool:
        return self.name in node.meta

    def set(self, node: torch.fx.Node, value: T) -> None:
        node.meta[self.name] = value


MODULE_PATH: MetaKey[str] = MetaKey(
    "smp.module_path", "dotted path of the innermost module this node came from ('' = root)")
PARAMS: MetaKey[tuple] = MetaKey(
    "smp.params", "fully qualified names of the parameters and buffers this node reads")
TENSOR: MetaKey[Any] = MetaKey(
    "smp.tensor", "passes.shape_prop.TensorInfo (or a tuple of them) for the node's output")
COST: MetaKey[Any] = MetaKey("smp.cost", "cost_model.NodeCost of the node")
PIN: MetaKey[int] = MetaKey(
    "smp.pin", "stage the node must be placed on (from smp.partition / default_partition)")
STAGE: MetaKey[int] = MetaKey("smp.stage", "pipeline stage chosen for the node")

TP: MetaKey[str] = MetaKey(
    "smp.tp", "tensor-parallel role of a node the rewrite made: col, row, lone or a collective")
TP_SPLIT: MetaKey[int] = MetaKey(
    "smp.tp_split", "dim along which tensor parallelism splits the node's value (each rank "
    "holds 1/tp of it: a column linear's features, attention's heads)")
TP_GATHERED: MetaKey[bool] = MetaKey(
    "smp.tp_gathered", "the value holds the tensor-parallel group's batches gathered "
    "(prescaled_batch false, between a tp_gather_batch and its tp_split_batch): its batch "
    "is tp times the rank's own")
CP_LOCAL: MetaKey[tuple[int, ...]] = MetaKey(
    "smp.cp_local", "dims of the node's value that hold only this rank's tokens (context "
    "parallelism: 1/cp of the sequence, though the value's traced size is the whole)")

SAVED: MetaKey[Any] = MetaKey(
    "smp.saved", "passes.annotate_costs.SavedValues: the values the node saves for backward "
    "(before deduplication across nodes) and the storage its output lives in")
CKPT_REGION: MetaKey[Any] = MetaKey(
    "smp.ckpt_region", "passes.checkpoint_regions.Region the node is recomputed in "
    "(activation checkpointing)")
GEMM: MetaKey[Any] = MetaKey(
    "smp.gemm", "(priced, runs): the cost_model.waves.Gemm the node's COST was priced at and "
    "the one this rank runs (a tensor-parallel shard); passes.reprice_gemms "
    "brings the first to the second")
GEMM_DTYPE: MetaKey[str] = MetaKey(
    "smp.gemm_dtype", "the dtype a weight GEMM does its math in where not its values' own "
    "('float8': a linear run as Transformer Engine's FP8 recipes run it; "
    "passes.fp8_linears)")
PLAIN_COST: MetaKey[Any] = MetaKey(
    "smp.plain_cost", "the node's COST without checkpointing (restored if its region is "
    "dropped)")

ALL_KEYS: tuple[MetaKey[Any], ...] = (MODULE_PATH, PARAMS, TENSOR, COST, PIN, STAGE, SAVED,
                                      CKPT_REGION, PLAIN_COST, TP, TP_SPLIT, TP_GATHERED,
                                      CP_LOCAL, GEMM, GEMM_DTYPE)
