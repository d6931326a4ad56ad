"""Expert parallelism's process groups (built by ``smp.init``) and rank queries.

``ep``: the ranks that split one set of experts between them and exchange tokens by
all-to-all; ``edp``: the ranks holding the same experts, over which those experts'
gradients are reduced (``smp_fx.world.expert_ranks`` draws both). They are stored in the
state's group tables under these names, so ``state.get().process_group("ep")`` finds them.
At degree 1 (or in one process) every rank is its own ep group and edp is the rdp group;
the singleton ep group is made when first asked for, by that rank alone.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from smp_fx.expert_ranks import edp_groups, ep_groups
from smp_fx.topology import Topology
from smp_fx.world import state as _state


def build(ep: int, topology: Topology, rank: int, backend: str, in_process: bool,
          wait: timedelta, groups: dict[str, Any], objects: dict[str, Any]
          ) -> tuple[Any, ...]:
    """Add the ep and edp groups to ``groups`` / ``objects`` (every rank, one order, as
    ``state.build_groups``); returns the groups this rank must destroy at reset."""
    if ep == 1 or in_process or topology.world_size == 1:
        groups["edp"], objects["edp"] = groups["rdp"], objects["rdp"]
        return ()
    need_twin = backend != "gloo"
    created: list[Any] = []
    for axis, draw in (("ep", ep_groups), ("edp", edp_groups)):
        for rdp in topology.groups("rdp"):
            for ranks in draw(rdp, ep):
                pg = dist.new_group(ranks, timeout=wait)
                twin = dist.new_group(ranks, timeout=wait, backend="gloo") if need_twin else pg
                if rank in ranks:
                    groups[axis], objects[axis] = pg, twin
                    created.extend([pg, twin] if need_twin else [pg])
    return tuple(created)


def ep_size() -> int:
    """Ranks that split each MoE block's experts (``expert_parallel_degree``)."""
    st = _state.get()
    return 1 if st.in_process else st.config.expert_parallel_degree


def ep_rank() -> int:
    """This rank's place in its ep group: it holds the ``ep_rank()``-th slice of experts."""
    return _state.get().axis_rank("rdp") % ep_size()


def get_ep_group() -> list[int]:
    """Global ranks of this rank's ep group."""
    st = _state.get()
    if ep_size() == 1:
        return [st.rank]
    return ep_groups(st.group_ranks("rdp"), ep_size())[st.axis_rank("rdp") // ep_size()]


def get_edp_group() -> list[int]:
    """Global ranks holding the same experts as this rank."""
    st = _state.get()
    return edp_groups(st.group_ranks("rdp"), ep_size())[ep_rank()]


def get_ep_process_group() -> Any:
    """The torch ProcessGroup of this rank's ep group."""
    st = _state.get()
    if "ep" not in st.groups:  # degree 1: a group of this rank alone
        st.groups["ep"] = st.groups["world"] if st.world_size == 1 else \
            _state.new_group([st.rank], use_local_synchronization=True)
    return st.groups["ep"]


def get_edp_process_group() -> Any:
    """The torch ProcessGroup over which this rank's experts' gradients are reduced."""
    return _state.get().groups["edp"]
