"""Expert slices under sharded data parallelism: sharded over the ranks holding them.

A slice is equal only on its edp group (the ranks holding the same experts), so it is
sharded over that group, not over the mesh of every other parameter: FSDP2's
per-parameter mesh (``shard_placement_fn``; torchtitan gives its experts a mesh of their
own likewise). The dispatch op reads the slices as attributes, never calling a module
FSDP2 could hook, so they join the stage's root unit: gathered before its forward, kept
until its backward has reduce-scattered their gradients (one gather per step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

from torch import nn

from smp_fx.expert_ranks import edp_groups
from smp_fx.parallel.meshes import hybrid_mesh
from smp_fx.world import expert_groups, state


def expert_shard_degree(sdp: int, rdp: int, ep: int) -> int:
    """Ranks of an edp group (``rdp / ep`` of them) a slice is sharded over: the largest
    common divisor of that and ``sdp``.

    >>> expert_shard_degree(2, 4, 2), expert_shard_degree(8, 8, 2), expert_shard_degree(2, 4, 4)
    (2, 4, 1)
    """
    return math.gcd(sdp, rdp // ep)


def shard_degree(st: state.State) -> int:
    """``expert_shard_degree`` of this rank's configuration (1: the slices stay whole)."""
    ep = expert_groups.ep_size()
    if ep == 1 or st.config.sharded_data_parallel_degree == 1:
        return 1
    return expert_shard_degree(st.config.sharded_data_parallel_degree, st.axis_size("rdp"), ep)


def expert_mesh(st: state.State) -> Any:
    """This rank's mesh over its edp group, sharded over ``shard_degree`` of its ranks
    (collective over the world: every edp group's sub-groups are created)."""
    ep = expert_groups.ep_size()
    groups = [g for rdp in st.topology.groups("rdp") for g in edp_groups(rdp, ep)]
    return hybrid_mesh(groups, shard_degree(st), st.rank,
                       expert_groups.get_edp_process_group(), st.device.type, "edp_")


def placement(experts: Collection[int], mesh: Any) -> Callable[[nn.Parameter], Any]:
    """FSDP2's ``shard_placement_fn``: the parameters whose ids are in ``experts`` on
    ``mesh`` (dim 0: experts), every other one as the unit's mesh has it."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard

    info = (FSDPMeshInfo(mesh, shard_mesh_dim=0) if mesh.ndim == 1
            else HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0))

    def place(param: nn.Parameter) -> Any:
        return ShardPlacementResult(Shard(0), info) if id(param) in experts else None

    return place
