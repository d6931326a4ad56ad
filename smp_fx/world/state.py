"""The process-wide state after ``smp.init``: configuration, topology, launch facts, groups.

Everything else in the runtime reads it through ``get()``; nothing else holds globals.

A single process with ``pipeline_parallel_degree > 1`` runs every stage itself
(``in_process``). Then ``pp_size``/``mp_size`` report the configured degree (the model still
has that many stages), every rank in a group is this one (``pp_rank() == 0``), and every
process group is the world group of one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPRuntimeError
from passes import axis_groups
from smp_fx.config import SMPConfig
from smp_fx.topology import Topology
from smp_fx.world import order_mode, state_api
from smp_fx.world.launch import LaunchInfo

log = logging.getLogger(__name__)

AXES_BUILT: tuple[str, ...] = ("mp", "dp", "pp", "tp", "rdp", "cp")  # creation order, every rank


@dataclass(frozen=True)
class State:
    """What ``smp.init`` established for this process. Read it via ``smp_fx.world.state.get()``."""

    config: SMPConfig
    topology: Topology
    launch: LaunchInfo
    backend: str
    device: torch.device
    in_process: bool
    owns_default_group: bool
    groups: dict[str, Any] = field(repr=False)
    """axis -> torch ProcessGroup on ``backend`` (``"world"`` included)."""
    object_groups: dict[str, Any] = field(repr=False)
    """axis -> a gloo ProcessGroup with the same ranks, for pickled Python objects."""
    created: tuple[Any, ...] = field(default=(), repr=False)
    """The non-default groups this init created (destroyed by ``_reset``)."""
    owned: list[Any] = field(default_factory=list, repr=False, compare=False)
    """Groups made for this state after ``smp.init`` (``new_group``: a lone ep group),
    destroyed by ``_reset`` with ``created``."""

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def local_size(self) -> int:
        return self.launch.local_size

    def axis_size(self, axis: str) -> int:
        """Size of ``axis`` ("world", "mp", "dp", "pp", "tp", "rdp", "cp") as smp.*_size
        reports."""
        if self.in_process:
            return {"pp": self.topology.pp_size, "mp": self.topology.mp_size}.get(axis, 1)
        return self.topology.size(axis)

    def axis_rank(self, axis: str) -> int:
        """This process's rank within its ``axis`` group."""
        if self.in_process:
            return 0
        return self.topology.group_rank(axis, self.rank)

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this process's ``axis`` group (sorted)."""
        if self.in_process:
            return [0]
        return self.topology.group(axis, self.rank)

    def process_group(self, group: Any) -> Any:
        """torch.distributed ProcessGroup for a ``CommGroup`` (or an axis name)."""
        return self.groups[_axis_of(group)]

    group = process_group  # the name docs/architecture.md uses

    def object_group(self, group: Any) -> Any:
        """gloo ProcessGroup (CPU) with the same ranks, for object send/broadcast/allgather."""
        return self.object_groups[_axis_of(group)]


def _axis_of(group: Any) -> str:
    return group if isinstance(group, str) else group.axis


_STATE: State | None = None


def get() -> State:
    """The state set by ``smp.init``; raises before it."""
    if _STATE is None:
        raise SMPRuntimeError.build(
            "smp.init() has not been called in this process", None, "smp_fx.world.state.get",
            "call smp.init(config) once at the start of the script, before other smp calls")
    return _STATE


def is_initialized() -> bool:
    return _STATE is not None


def __getattr__(name: str) -> Any:
    """``smp.state.cfg`` and ``smp.state.module_manager``, the two attributes of SMP's state
    object that scripts read (``smp_fx.world.state_api``); ``cfg`` needs ``smp.init``."""
    if name == "cfg":
        return state_api.ConfigView(get().config)
    if name == "module_manager":
        return state_api.module_manager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _set(state: State) -> None:
    global _STATE
    _STATE = state


def _reset() -> None:
    """Forget the state and destroy the process groups ``smp.init`` created (tests use this
    to call ``smp.init`` several times in one process)."""
    global _STATE
    state, _STATE = _STATE, None
    order_mode.uninstall()
    axis_groups.unbind_all()  # the tp and cp groups (and their stores) must not outlive it
    if state is None or not dist.is_initialized():
        return
    if state.owns_default_group:
        dist.destroy_process_group()
        return
    for pg in (*state.created, *state.owned):
        dist.destroy_process_group(pg)
    state.owned.clear()


def new_group(ranks: Sequence[int] | None = None, **kwargs: Any) -> Any:
    """``dist.new_group`` (collective over the world: every rank calls it, in one order)
    for the state's own use after ``smp.init``; ``_reset`` destroys it on its members."""
    pg = dist.new_group(None if ranks is None else list(ranks), **kwargs)
    if _STATE is not None and pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
        _STATE.owned.append(pg)
    return pg


_SHARED: dict[tuple[Any, ...], Any] = {}
_SHARED_WORLD: list[Any] = []
_SHARED_SPOILT: list[str] = []
"""Why the shared groups may not serve another model (empty: they may)."""


def shared_group(tag: tuple[Any, ...], ranks: Sequence[int] | None = None,
                 backend: str | None = None) -> Any:
    """A process group of ``ranks`` (the world's by default) made once per default group
    and ``tag`` and handed to every later caller: the pipeline's channel groups, which
    every ``DistributedModel`` of the process shares. Each is quiescent between steps (a
    step ends with every receive met and every send waited: ``DistTransport.finish``), so
    models whose steps run one after another can share it; a model still used after the
    state's reset keeps working, and a process that calls ``smp.init`` again holds one set,
    not one per model (a gloo group keeps a connection thread and two workers alive: 300
    idle groups cost a rank 15 % of a core). Collective on first use, as ``new_group``;
    ``renew_spoilt_shared`` replaces them after a failed step."""
    world = dist.group.WORLD
    if not _SHARED_WORLD or _SHARED_WORLD[0] is not world:  # a new default group
        _SHARED.clear()
        _SHARED_WORLD[:] = [world]
    key = (backend, tuple(ranks) if ranks is not None else None, *tag)
    if key not in _SHARED:
        _SHARED[key] = dist.new_group(None if ranks is None else list(ranks),
                                      backend=backend)
    return _SHARED[key]


def spoil_shared(reason: str) -> None:
    """Mark the shared groups as unfit for another model: a step failed while they carried
    its messages (a receive left posted, a send unmet, or a connection that gloo closed on
    a timeout), which a later model's step would meet instead of its own."""
    if not _SHARED_SPOILT:
        _SHARED_SPOILT.append(reason)


def renew_spoilt_shared() -> None:
    """Collective over the world (every rank, before it takes shared groups for a model):
    if a step failed on any rank since the last call (``spoil_shared``), every rank drops
    its shared groups, so the groups handed out next are new ones, made in one order on
    every rank. The dropped ones stay with the models that hold them (their pending work
    is not waited on). The flag goes over the world's gloo group: the state's object
    group, or the default group without ``smp.init``."""
    group = _STATE.object_group("world") if _STATE is not None else dist.group.WORLD
    flag = torch.tensor([1 if _SHARED_SPOILT else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    reason = _SHARED_SPOILT[0] if _SHARED_SPOILT else "a step failed on another rank"
    _SHARED_SPOILT.clear()
    if int(flag.item()):
        log.warning("smp-fx: the pipeline's process groups are made anew for this model: "
                    "%s; the earlier ones may still hold that step's messages", reason)
        _SHARED.clear()


def build_groups(topology: Topology, rank: int, backend: str, in_process: bool,
                 wait: timedelta) -> tuple[dict[str, Any], dict[str, Any], tuple[Any, ...]]:
    """Create every axis's process groups, on every rank, in one fixed order.

    ``new_group`` is collective over the whole world, so all ranks walk the same list:
    axes in ``AXES_BUILT`` order, groups of an axis by smallest member. A rank list seen
    before (e.g. dp == rdp when tp == 1) or equal to the world reuses that group.
    Returns (groups, object_groups, created).
    """
    world = dist.group.WORLD
    need_twin = backend != "gloo"
    world_obj = dist.new_group(backend="gloo", timeout=wait) if need_twin else world
    groups: dict[str, Any] = {"world": world}
    objects: dict[str, Any] = {"world": world_obj}
    created: list[Any] = [world_obj] if need_twin else []
    if in_process or topology.world_size == 1:
        for axis in AXES_BUILT:
            groups[axis], objects[axis] = world, world_obj
        return groups, objects, tuple(created)
    everyone = tuple(range(topology.world_size))
    cache: dict[tuple[int, ...], tuple[Any, Any]] = {everyone: (world, world_obj)}
    for axis in AXES_BUILT:
        for ranks in topology.groups(axis):
            key = tuple(ranks)
            if key not in cache:
                pg = dist.new_group(list(key), timeout=wait)
                twin = dist.new_group(list(key), timeout=wait, backend="gloo") \
                    if need_twin else pg
                if rank in key:  # other ranks get NON_GROUP_MEMBER: nothing to destroy
                    created.extend([pg, twin] if need_twin else [pg])
                cache[key] = (pg, twin)
            if rank in key:
                groups[axis], objects[axis] = cache[key]
    return groups, objects, tuple(created)
