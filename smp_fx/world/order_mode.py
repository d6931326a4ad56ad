"""``SMP_FX_CHECK_ORDER=1``: NCCL's ordering rule checked on any backend, gloo included.

Off (the default) nothing is wrapped. On (set on every rank), ``smp.init`` wraps the
``ProcessGroup`` methods every ``torch.distributed`` call ends in (the transport's direct
sends too) and DTensor's functional collectives: each call is recorded per group at issue
time with its op, shapes, dtypes and peer or root. At each ``smp.step``'s end
(``checked_step``) the records are gathered over a gloo group of the checker's own and
compared (``order_check``); the first mismatch raises ``SMPOrderError`` on every rank."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPPeerError, SMPTimeoutError
from smp_fx.world.order_check import COLLECTIVE, RECV, SEND, Call, GroupLog, first_mismatch

ENV = "SMP_FX_CHECK_ORDER"
COMPILED = (f"{ENV}: collectives traced into compiled stages (tensor parallelism under "
            "`compile`) run inside the stage's graph and are not recorded; the ones around "
            "them are. Set `compile: none` to check them too.")
log = logging.getLogger(__name__)

# ProcessGroup method -> (op, kind, position of the argument whose tensors every rank of
# the group passes alike: the input side, the output of a scatter, a message's buffer).
_METHODS: dict[str, tuple[str, str, int]] = {
    "allreduce": ("all_reduce", COLLECTIVE, 0),
    "allreduce_coalesced": ("all_reduce", COLLECTIVE, 0),
    "broadcast": ("broadcast", COLLECTIVE, 0),
    "reduce": ("reduce", COLLECTIVE, 0),
    "allgather": ("all_gather", COLLECTIVE, 1),
    "_allgather_base": ("all_gather", COLLECTIVE, 1),
    "all_gather_single": ("all_gather", COLLECTIVE, 1),
    "allgather_coalesced": ("all_gather", COLLECTIVE, 1),
    "allgather_into_tensor_coalesced": ("all_gather", COLLECTIVE, 1),
    "all_gather_single_coalesced": ("all_gather", COLLECTIVE, 1),
    "gather": ("gather", COLLECTIVE, 1),
    "scatter": ("scatter", COLLECTIVE, 0),
    "reduce_scatter": ("reduce_scatter", COLLECTIVE, 1),
    "_reduce_scatter_base": ("reduce_scatter", COLLECTIVE, 1),
    "reduce_scatter_single": ("reduce_scatter", COLLECTIVE, 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", COLLECTIVE, 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", COLLECTIVE, 1),
    "alltoall": ("all_to_all", COLLECTIVE, 1),
    "alltoall_base": ("all_to_all", COLLECTIVE, 1),
    "all_to_all_single": ("all_to_all", COLLECTIVE, 1),
    "barrier": ("barrier", COLLECTIVE, -1),
    "monitored_barrier": ("barrier", COLLECTIVE, -1),
    "send": ("send", SEND, 0),
    "recv": ("recv", RECV, 0),
    "recv_anysource": ("recv", RECV, 0),
}
_SIZES_MAY_DIFFER = {"all_to_all"}  # per-rank splits: only the dtypes must agree
# DTensor's functional collectives (torch.distributed._functional_collectives) -> op.
_FUNCOL = {"broadcast": "broadcast", "all_reduce": "all_reduce",
           "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
           "all_reduce_coalesced": "all_reduce", "all_to_all_single": "all_to_all",
           "all_gather_single_coalesced": "all_gather",
           "reduce_scatter_single_coalesced": "reduce_scatter"}


_SKIPPED = (os.path.dirname(torch.__file__), __file__)


def _site() -> str:
    """The line that issued the call: the first frame outside torch and this module with a
    file of its own (not fx's generated code, whose names differ between processes)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIPPED) and not path.startswith("<"):
            return f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}" \
                   f":{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return ""


def enabled() -> bool:
    return os.environ.get(ENV, "0") not in ("", "0")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class _Recorder:
    """This rank's calls per group since the last check (see the module doc)."""

    def __init__(self, side: Any, labels: dict[int, str]) -> None:
        self.side = side
        self.labels = labels  # id(process group) -> how an error names it
        self.step = 0
        self.paused = 0  # inside ``paused``: nothing compared
        self._lock = threading.Lock()
        self._calls: dict[str, list[Call]] = {}
        self._seq: dict[str, int] = {}
        self._groups: dict[str, tuple[tuple[int, ...], str]] = {}

    def _group(self, pg: Any, name: str) -> tuple[tuple[int, ...], str]:
        known = self._groups.get(name)
        if known is None:
            known = self._groups[name] = (tuple(dist.get_process_group_ranks(pg)),
                                          self.labels.get(id(pg), "a group"))
        return known

    def record(self, pg: Any, op: str, kind: str, tensors: list[torch.Tensor],
               peer: int | None = None, root: int | None = None) -> None:
        """``peer``: the other rank of a send or receive, as ``pg`` numbers it."""
        if pg is self.side:
            return
        name = str(pg.group_name)
        shapes = () if op in _SIZES_MAY_DIFFER else tuple(tuple(t.shape) for t in tensors)
        dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
        site = _site() if kind == COLLECTIVE else ""
        with self._lock:
            ranks, _ = self._group(pg, name)
            seq = self._seq.get(name, 0)
            self._seq[name] = seq + 1
            self._calls.setdefault(name, []).append(Call(
                seq, op, kind, shapes, dtypes, None if peer is None else ranks[peer], root,
                site))

    def take(self) -> dict[str, GroupLog]:
        with self._lock:
            calls, self._calls = self._calls, {}
        return {name: GroupLog(*self._groups[name], tuple(cs)) for name, cs in calls.items()}

    def check(self, failed: bool = False) -> None:
        """Gather every rank's calls since the last check; raise on the first mismatch.
        A step that failed on some rank (``failed`` there) is not compared: its ranks
        stopped at different places."""
        if self.paused:
            return
        self.step += 1
        logs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(logs, (failed, self.take()), group=self.side)
        stopped = [r for r, (f, _) in enumerate(logs) if f]
        if stopped:
            log.warning("%s: step %d failed on ranks %s; its calls were not compared", ENV,
                        self.step, stopped)
            return
        hit = first_mismatch([calls for _, calls in logs])
        if hit is not None:
            raise hit.error(self.step)


_ACTIVE: _Recorder | None = None
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _method(name: str, op: str, kind: str, arg: int) -> Callable[..., Any]:
    original = getattr(dist.ProcessGroup, name)

    def recorded(pg: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _ACTIVE
        if rec is not None:
            tensors = list(_tensors(args[arg])) if 0 <= arg < len(args) else []
            opts = [a for a in (*args, *kwargs.values()) if hasattr(a, "rootRank")]
            peer = args[1] if kind != COLLECTIVE and name != "recv_anysource" else None
            rec.record(pg, op, kind, tensors, peer, opts[0].rootRank if opts else None)
        return original(pg, *args, **kwargs)

    return recorded


def _functional(fn: Callable[..., Any], op: str) -> Callable[..., Any]:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    signature = inspect.signature(fn)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        rec = _ACTIVE
        if rec is not None and not torch.compiler.is_compiling():  # see COMPILED
            bound = signature.bind(*args, **kwargs).arguments
            name = funcol._resolve_group_name(bound["group"], bound.get("tag", ""))
            pg = c10d._resolve_process_group(name)
            src = bound.get("src")
            root = None if src is None else dist.get_process_group_ranks(pg).index(src)
            rec.record(pg, op, COLLECTIVE, list(_tensors(args[0])), None, root)
        return fn(*args, **kwargs)

    return recorded


def _labels(groups: dict[str, Any], objects: dict[str, Any]) -> dict[int, str]:
    """id(process group) -> how errors name it: the axes it serves ("the world/dp group")."""
    axes: dict[int, list[str]] = {}
    kind: dict[int, str] = {}
    for what, named in (("object group", objects), ("group", groups)):
        for axis, pg in named.items():
            axes.setdefault(id(pg), []).append(axis)
            kind[id(pg)] = what  # a group serving computes and objects (gloo): "group"
    return {k: f"the {'/'.join(dict.fromkeys(v))} {kind[k]}" for k, v in axes.items()}


def install(wait: timedelta, groups: dict[str, Any], objects: dict[str, Any]) -> None:
    """Start recording (collective: every rank, from ``smp.init``, with the mode on);
    ``groups`` / ``objects``: smp's groups by axis, named by errors."""
    global _ACTIVE
    from torch.distributed import _functional_collectives as funcol

    if _ACTIVE is not None:
        return
    side = dist.new_group(backend="gloo", timeout=wait)
    # The class's own entries are kept (a pybind method read through ``getattr`` is an
    # unbound function, which put back would no longer bind ``self``).
    for name, (op, kind, arg) in _METHODS.items():
        if name in vars(dist.ProcessGroup):
            _ORIGINALS[(dist.ProcessGroup, name)] = vars(dist.ProcessGroup)[name]
            setattr(dist.ProcessGroup, name, _method(name, op, kind, arg))
    for name, op in _FUNCOL.items():
        if name in vars(funcol):
            _ORIGINALS[(funcol, name)] = vars(funcol)[name]
            setattr(funcol, name, _functional(vars(funcol)[name], op))
    _ACTIVE = _Recorder(side, _labels(groups, objects))


def uninstall() -> None:
    """Stop recording, put torch's functions back and drop the checker's group."""
    global _ACTIVE
    rec, _ACTIVE = _ACTIVE, None
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()
    if rec is not None and dist.is_initialized():
        dist.destroy_process_group(rec.side)


@contextlib.contextmanager
def paused(where: str) -> Iterator[None]:
    """No comparison inside ``where``, and its calls dropped at the end (logged): under
    ``DistributedModel.join()`` a rank out of data shadows the others' steps (fewer
    ``smp.step`` calls, the same collectives issued from other lines)."""
    rec = _ACTIVE
    if rec is None:
        yield
        return
    rec.paused += 1
    try:
        yield
    finally:
        rec.paused -= 1
        if not rec.paused:
            dropped = sum(len(g.calls) for g in rec.take().values())
            log.warning("%s: %d calls inside %s were not compared (its ranks may step "
                        "unevenly)", ENV, dropped, where)


@contextlib.contextmanager
def checked_step() -> Iterator[None]:
    """Around an ``smp.step``: compare its calls at its end when the mode is on. A rank
    whose step raised still takes part in the gather (so the others do not wait for it),
    then re-raises; not after a lost or silent peer, whose gather would only time out."""
    rec = _ACTIVE
    if rec is None:
        yield
        return
    try:
        yield
    except (SMPPeerError, SMPTimeoutError):
        raise
    except BaseException:
        try:
            rec.check(failed=True)
        except Exception as exc:  # the step's own error is the one to see
            log.warning("%s: the failed step's check failed too: %s", ENV, exc)
        raise
    rec.check()
