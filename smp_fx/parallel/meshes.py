"""FSDP2 meshes over SMP's groups: sharded over some ranks of a group, replicated over the
rest (HSDP), shared by sharded data parallelism and the expert slices it shards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_MESHES: list[int] = []
"""One entry per mesh this process built (their names' numbers)."""


def hybrid_mesh(groups: Sequence[Sequence[int]], shard: int, rank: int, whole: Any,
                device_type: str, prefix: str) -> Any:
    """This rank's FSDP2 mesh over its group of ``groups`` (every such group of the world,
    in creation order): sharded over consecutive ``shard`` of its ranks, replicated over
    the rest (HSDP); ``whole`` is the process group of the whole group. Every rank creates
    every sub-group in one order first (``new_group`` is collective over the world)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mine = next(list(g) for g in groups if rank in g)
    # DTensor caches sharding results holding meshes by value (ranks, names): a mesh of a
    # later smp.init over the same ranks would be answered with this one's groups, which
    # that init destroyed. A name of its own per mesh keeps them apart.
    _MESHES.append(len(_MESHES))
    tag = f"_{_MESHES[-1]}"
    if shard == len(mine):
        return DeviceMesh.from_group(whole, device_type, mesh_dim_names=(prefix + "shard" + tag,))
    shard_of: dict[int, Any] = {}
    rep_of: dict[int, Any] = {}
    for ranks in groups:
        grid = [list(ranks[i:i + shard]) for i in range(0, len(ranks), shard)]
        for row in grid:
            g = dist.new_group(row)
            shard_of.update({r: g for r in row})
        for col in zip(*grid):
            g = dist.new_group(list(col))
            rep_of.update({r: g for r in col})
    layout = torch.tensor(mine).view(len(mine) // shard, shard)
    return DeviceMesh.from_group([rep_of[rank], shard_of[rank]], device_type, mesh=layout,
                                 mesh_dim_names=(prefix + "replicate" + tag,
                                                 prefix + "shard" + tag))
