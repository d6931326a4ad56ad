"""SMP's rank queries, group getters and object communication (``smp.rank()``, ``smp.send``...).

Objects travel over gloo groups mirroring the compute groups, so they work on CPU and
beside NCCL; every wait is bounded and a timeout names what was awaited.
``smp.broadcast`` is the sender side only: the others ``smp.recv_from``, as in SMP.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from cost_model.errors import SMPRuntimeError, SMPTimeoutError
from smp_fx.world import state as _state

T = TypeVar("T")


class CommGroup(enum.Enum):
    """A kind of process group; the group meant is the one containing the calling rank."""

    WORLD = "world"
    MP_GROUP = "mp"
    DP_GROUP = "dp"
    PP_GROUP = "pp"
    TP_GROUP = "tp"
    RDP_GROUP = "rdp"

    @property
    def axis(self) -> str:
        return self.value


class RankType(enum.Enum):
    """How a rank number is read: within the world, or within one of this rank's groups."""

    WORLD_RANK = "world"
    MP_RANK = "mp"
    DP_RANK = "dp"
    PP_RANK = "pp"
    TP_RANK = "tp"
    RDP_RANK = "rdp"

    @property
    def axis(self) -> str:
        return self.value


WORLD, MP_GROUP, DP_GROUP = CommGroup.WORLD, CommGroup.MP_GROUP, CommGroup.DP_GROUP
PP_GROUP, TP_GROUP, RDP_GROUP = CommGroup.PP_GROUP, CommGroup.TP_GROUP, CommGroup.RDP_GROUP
WORLD_RANK, MP_RANK, DP_RANK = RankType.WORLD_RANK, RankType.MP_RANK, RankType.DP_RANK
PP_RANK, TP_RANK, RDP_RANK = RankType.PP_RANK, RankType.TP_RANK, RankType.RDP_RANK


# --- ranks and sizes ---------------------------------------------------------------------
def rank() -> int:
    """Global rank of this process."""
    return _state.get().rank


def size() -> int:
    """Number of processes in the job."""
    return _state.get().world_size


def local_rank() -> int:
    """Rank among the processes on this node (use it for ``torch.cuda.set_device``)."""
    return _state.get().local_rank


def local_size() -> int:
    return _state.get().local_size


def mp_rank() -> int:
    return _state.get().axis_rank("mp")


def mp_size() -> int:
    return _state.get().axis_size("mp")


def dp_rank() -> int:
    return _state.get().axis_rank("dp")


def dp_size() -> int:
    return _state.get().axis_size("dp")


def pp_rank() -> int:
    return _state.get().axis_rank("pp")


def pp_size() -> int:
    return _state.get().axis_size("pp")


def tp_rank() -> int:
    return _state.get().axis_rank("tp")


def tp_size() -> int:
    return _state.get().axis_size("tp")


def rdp_rank() -> int:
    return _state.get().axis_rank("rdp")


def cp_rank() -> int:
    """Rank in the context-parallel group (smp-fx extension: ``context_parallel_degree``)."""
    return _state.get().axis_rank("cp")


def cp_size() -> int:
    """Ranks splitting one sequence (``context_parallel_degree``; 1 without it)."""
    return _state.get().axis_size("cp")


def num_microbatches() -> int:
    """The configured ``microbatches`` (SMP 1.x's ``smp.num_microbatches()``, which AWS's
    Mask R-CNN example divides its per-step box counts by)."""
    return _state.get().config.microbatches


def rdp_size() -> int:
    return _state.get().axis_size("rdp")


# --- groups ------------------------------------------------------------------------------
def get_mp_group() -> list[int]:
    """Global ranks holding the same model replica as this one (same rdp_rank)."""
    return _state.get().group_ranks("mp")


def get_dp_group() -> list[int]:
    """Global ranks holding the same pipeline stage as this one (same pp_rank)."""
    return _state.get().group_ranks("dp")


def get_pp_group() -> list[int]:
    return _state.get().group_ranks("pp")


def get_tp_group() -> list[int]:
    return _state.get().group_ranks("tp")


def get_rdp_group() -> list[int]:
    return _state.get().group_ranks("rdp")


def get_cp_group() -> list[int]:
    """Global ranks splitting the same sequences as this one (same pp, tp and rdp ranks)."""
    return _state.get().group_ranks("cp")


def get_world_process_group() -> Any:
    return _state.get().process_group(WORLD)


def get_mp_process_group() -> Any:
    return _state.get().process_group(MP_GROUP)


def get_dp_process_group() -> Any:
    return _state.get().process_group(DP_GROUP)


def get_pp_process_group() -> Any:
    return _state.get().process_group(PP_GROUP)


def get_tp_process_group() -> Any:
    return _state.get().process_group(TP_GROUP)


def get_rdp_process_group() -> Any:
    return _state.get().process_group(RDP_GROUP)


def get_cp_process_group() -> Any:
    return _state.get().process_group("cp")


# --- synchronisation and objects ------------------------------------------------------------
def _bounded(what: str, fn: Callable[[], T]) -> T:
    """Run a blocking call; turn the process group's timeout into an error that names it."""
    try:
        return fn()
    except RuntimeError as exc:  # DistBackendError and gloo's timeouts are RuntimeErrors
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            st = _state.get()
            raise SMPTimeoutError.build(f"timed out waiting for {what}", None,
                                        f"rank {st.rank}",
                                        "check that every rank makes the matching call; raise "
                                        "SMP_FX_TIMEOUT_S if the work is just slow") from exc
        raise


def _group(group: CommGroup) -> CommGroup:
    if not isinstance(group, CommGroup):
        raise SMPRuntimeError.build("group must be an smp.CommGroup", group, "smp comm",
                                    "use smp.WORLD, smp.MP_GROUP, smp.DP_GROUP, ...")
    return group


def barrier(group: CommGroup = WORLD) -> None:
    """Wait until every process of this rank's ``group`` arrives here."""
    pg = _state.get().object_group(_group(group))
    _bounded(f"barrier({group.name})", lambda: dist.barrier(group=pg))


def dp_barrier() -> None:
    barrier(DP_GROUP)


def mp_barrier() -> None:
    barrier(MP_GROUP)


def _global_rank(peer: int, rank_type: RankType) -> int:
    if not isinstance(rank_type, RankType):
        raise SMPRuntimeError.build("rank_type must be an smp.RankType", rank_type,
                                    "smp.send / smp.recv_from", "use e.g. smp.RankType.MP_RANK")
    st = _state.get()
    members = st.group_ranks(rank_type.axis)
    if not 0 <= peer < len(members):
        raise SMPRuntimeError.build(f"{rank_type.name} must be in [0, {len(members)})", peer,
                                    f"rank {st.rank}", f"this rank's group is {members}")
    target = members[peer]
    if target == st.rank:
        raise SMPRuntimeError.build("a process cannot send to or receive from itself",
                                    (peer, rank_type.name), f"rank {st.rank}",
                                    "address another rank of the group")
    return target


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send a picklable ``obj`` to ``dest_rank`` (read as ``rank_type``); returns once the
    peer's matching ``recv_from`` has it."""
    st = _state.get()
    dst = _global_rank(dest_rank, rank_type)
    _bounded(f"send to rank {dst}",
             lambda: dist.send_object_list([obj], dst=dst, group=st.object_group(WORLD)))


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive the object a matching ``send`` or ``broadcast`` from ``src_rank`` sent."""
    st = _state.get()
    src = _global_rank(src_rank, rank_type)
    box: list[Any] = [None]
    _bounded(f"recv_from rank {src}",
             lambda: dist.recv_object_list(box, src=src, group=st.object_group(WORLD)))
    return box[0]


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send ``obj`` to every other member of this rank's ``group`` (they call ``recv_from``)."""
    st = _state.get()
    for dst in st.group_ranks(_group(group).axis):
        if dst != st.rank:
            send(obj, dst, WORLD_RANK)


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """Collective: the i-th entry is the object of the i-th rank of this rank's ``group``."""
    st = _state.get()
    pg = st.object_group(_group(group))
    out: list[Any] = [None] * len(st.group_ranks(group.axis))
    _bounded(f"allgather({group.name})", lambda: dist.all_gather_object(out, obj, group=pg))
    return out


RowsRead = Callable[[], list[list[float]]]


def row_gather(group: CommGroup, width: int) -> Callable[[Sequence[float]], RowsRead]:
    """Launch: all-gather a row of ``width`` floats over ``group`` without waiting; the
    returned read waits (bounded) and gives one row per rank. One preallocated tensor, not
    ``allgather``'s pickles: 0.1-0.15 ms of CPU per exchange (launch and read) against
    0.45-0.7 ms, whose wall time is 1.2-2.7 (2 ranks, ``benchmarks/row_gather.py``); and no
    rank waits for the others at the launch."""
    st = _state.get()
    pg = st.object_group(_group(group))
    row = torch.zeros(width, dtype=torch.float64)
    out = torch.zeros(len(st.group_ranks(group.axis)), width, dtype=torch.float64)
    rows = list(out.unbind(0))
    unread: list[bool] = [False]

    def launch(values: Sequence[float]) -> RowsRead:
        if unread[0]:  # the buffers are the pending exchange's until it is read
            raise SMPRuntimeError.build("a row gather was launched before the last was read",
                                        group.name, f"rank {st.rank}",
                                        "call the read the last launch returned first")
        row.copy_(torch.as_tensor(values, dtype=torch.float64))
        work = pg.allgather([rows], [row])  # the group's own: c10d's checks cost 0.02-0.07 ms
        unread[0] = True

        def read() -> list[list[float]]:
            _bounded(f"row_gather({group.name})", work.wait)
            unread[0] = False
            return out.tolist()

        return read

    return launch
