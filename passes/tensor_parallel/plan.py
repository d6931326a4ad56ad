"""What the tensor-parallel rewrite did, as data: ``ShardSpec`` per distributed parameter,
``TensorParallelPlan`` for the model, and ``merge_shards`` (the full tensor back).

Kept apart from the rewrite (``passes.tensor_parallel``, which re-exports them) because
checkpoints, the CLI and the runtime read plans without rewriting anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from passes.tensor_parallel import graph


@dataclass(frozen=True)
class ShardSpec:
    """One distributed parameter: split along ``dim`` into ``parts`` equal pieces.

    ``stride`` > 1: along ``dim`` the full tensor is ``stride`` equal blocks (a fused
    q/k/v projection: 3), each split into ``parts`` pieces; rank r holds piece r of every
    block, concatenated in block order. Merging: cut each rank's shard into ``stride``
    blocks, concatenate the ranks' block b pieces, then the blocks.

    ``pad`` > 0: ``pad`` zero rows were appended along ``dim`` before splitting (a
    vocabulary not divisible by the degree: ``ceil(V / parts)`` rows per rank).
    ``full_shape`` is the unpadded shape, the one ``state_dict()`` and checkpoints hold."""

    name: str
    dim: int
    parts: int
    full_shape: tuple[int, ...]
    stride: int = 1
    pad: int = 0

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of one rank's shard (padding included)."""
        shape = list(self.full_shape)
        shape[self.dim] = (shape[self.dim] + self.pad) // self.parts
        return tuple(shape)

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "dim": self.dim, "parts": self.parts,
               "full_shape": list(self.full_shape)}
        out |= {"stride": self.stride} if self.stride != 1 else {}
        return out | ({"pad": self.pad} if self.pad else {})

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> ShardSpec:
        return ShardSpec(d["name"], d["dim"], d["parts"], tuple(d["full_shape"]),
                         int(d.get("stride", 1)), int(d.get("pad", 0)))


@dataclass(frozen=True)
class TensorParallelPlan:
    """What the pass did: sharded parameters and the regions left replicated, with why."""

    size: int
    sharded: tuple[ShardSpec, ...] = ()
    replicated: tuple[tuple[str, str], ...] = ()
    pairs: tuple[tuple[str, str], ...] = field(default=())
    sequence_parallel: tuple[str, ...] = ()
    """``optimize: "memory"``: the replicated parameters read by sequence-chunked ops
    (``passes.tensor_parallel.sequence``), whose gradients are summed over the tp group."""

    def to_json(self) -> dict[str, Any]:
        out = {"size": self.size, "sharded": [s.to_json() for s in self.sharded],
               "replicated": [list(r) for r in self.replicated],
               "pairs": [list(p) for p in self.pairs]}
        return out | ({"sequence_parallel": list(self.sequence_parallel)}
                      if self.sequence_parallel else {})

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> TensorParallelPlan:
        return TensorParallelPlan(d["size"], tuple(ShardSpec.from_json(s) for s in d["sharded"]),
                                  tuple((a, b) for a, b in d["replicated"]),
                                  tuple((a, b) for a, b in d["pairs"]),
                                  tuple(d.get("sequence_parallel", ())))

    def shard_spec(self, name: str) -> ShardSpec | None:
        return next((s for s in self.sharded if s.name == name), None)


def merge_shards(spec: ShardSpec, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the ranks' shards (in rank order), strides honoured and the
    padding rows dropped: exactly the unsharded parameter's shape."""
    return graph.unpad(graph.unshard(shards, spec.dim, spec.stride), spec.dim, spec.pad)


__all__ = ["ShardSpec", "TensorParallelPlan", "merge_shards"]
