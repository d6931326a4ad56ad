"""What the tensor-parallel rewrite did, as data: ``ShardSpec``, ``TensorParallelPlan`` and
``merge_shards``; apart from the rewrite because checkpoints, CLI and runtime read plans.
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

    ``stride`` blocks (fused q/k/v: 3) are each split, rank r holding piece r of every
    block; ``pad`` zero rows pad an indivisible vocabulary; ``full_shape`` is unpadded."""

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
    """What the pass did: the sharded parameters, the linears and embeddings left whole
    (module, why: ``replicated``; also a marked region with nothing to shard), the column
    -> row pairs, the lone linears (module, why no partner), and ``elements``: (parameter
    elements sharded, all of the model's), each tensor once."""

    size: int
    sharded: tuple[ShardSpec, ...] = ()
    replicated: tuple[tuple[str, str], ...] = ()
    pairs: tuple[tuple[str, str], ...] = field(default=())
    sequence_parallel: tuple[str, ...] = ()
    """``optimize: "memory"``: the replicated parameters read by sequence-chunked ops
    (``passes.tensor_parallel.sequence``), whose gradients are summed over the tp group."""
    lone: tuple[tuple[str, str], ...] = ()
    elements: tuple[int, int] = (0, 0)

    @property
    def share(self) -> float:
        """The share of the model's parameter elements that are sharded (0 to 1)."""
        done, total = self.elements
        return done / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        out = {"size": self.size, "sharded": [s.to_json() for s in self.sharded],
               "replicated": [list(r) for r in self.replicated],
               "pairs": [list(p) for p in self.pairs]}
        out |= {"lone": [list(r) for r in self.lone]} if self.lone else {}
        out |= {"elements": list(self.elements)} if any(self.elements) else {}
        return out | ({"sequence_parallel": list(self.sequence_parallel)}
                      if self.sequence_parallel else {})

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> TensorParallelPlan:
        done, total = d.get("elements", (0, 0))
        return TensorParallelPlan(d["size"], tuple(ShardSpec.from_json(s) for s in d["sharded"]),
                                  tuple((a, b) for a, b in d["replicated"]),
                                  tuple((a, b) for a, b in d["pairs"]),
                                  tuple(d.get("sequence_parallel", ())),
                                  tuple((a, b) for a, b in d.get("lone", ())),
                                  (int(done), int(total)))

    def shard_spec(self, name: str) -> ShardSpec | None:
        return next((s for s in self.sharded if s.name == name), None)


def merge_shards(spec: ShardSpec, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the ranks' shards (in rank order), strides honoured and the
    padding rows dropped: exactly the unsharded parameter's shape."""
    return graph.unpad(graph.unshard(shards, spec.dim, spec.stride), spec.dim, spec.pad)


__all__ = ["ShardSpec", "TensorParallelPlan", "merge_shards"]
