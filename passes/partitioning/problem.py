"""The partitioning problem as numbers, and the one objective every strategy is scored by.

``DagProblem`` holds no torch objects, so algorithms and benchmarks can build one from
random numbers. Stage ``s`` costs ``(1 - w) max(time_s, link_time(bytes_s)) / T + w
memory_s / M``: sends overlap compute and latency is paid in fill and drain, not per
stage. See docs/architecture.md, 'Stage time model', and docs/partitioning.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cost_model import roofline
from cost_model import schedule as sched
from cost_model.devices import DEFAULT_DEVICE, get_device
from passes.partition_config import PartitionConfig
from passes.partitioning.chain import Ints, Values

if TYPE_CHECKING:  # imported where a graph is built: every process importing smp_fx
    import networkx as nx  # would pay for it (0.17 CPU s) otherwise

CommTime = Callable[[float], float]


def link_occupancy(comm_time: CommTime) -> CommTime:
    """The link time of a message: ``comm_time(2b) - comm_time(b)``, exactly ``b / bandwidth``
    for the affine model (the latency cancels)."""

    def link_time(nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return max(comm_time(2.0 * nbytes) - comm_time(nbytes), 0.0)

    return link_time


@dataclass(frozen=True)
class DagProblem:
    """Compute nodes ``0..n-1`` in a topological order (the graph's), and their values.

    ``val_producer[v] == -1`` marks a graph input; ``val_to_output[v]`` keeps a value live
    up to the output's stage."""

    names: tuple[str, ...]
    time: np.ndarray
    saved: np.ndarray
    preds: tuple[tuple[int, ...], ...]
    val_producer: tuple[int, ...]
    val_bytes: np.ndarray
    val_consumers: tuple[tuple[int, ...], ...]
    val_to_output: tuple[bool, ...]
    output_inputs: tuple[int, ...]
    param_names: tuple[str, ...] = ()
    param_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    param_readers: tuple[tuple[int, ...], ...] = ()
    module_paths: tuple[str, ...] = ()
    pins: tuple[int, ...] = ()
    flops: np.ndarray = field(default_factory=lambda: np.zeros(0))
    param_aliases: tuple[tuple[str, ...], ...] = ()
    """Per parameter, every name of its tensor (tied weights); empty: the name alone."""

    def heavy(self) -> np.ndarray:
        """Nodes doing real work: FLOPs or parameters (time when FLOPs are not known); every
        stage gets one when there are enough, so no stage holds only glue."""
        work = self.flops > 0 if len(self.flops) == self.n else self.time > 0
        mask = np.array(work, dtype=bool)
        rflat, rparam = self._flat[5:]
        if rflat.size:
            mask[rflat[self.param_bytes[rparam] > 0]] = True
        return mask

    @property
    def n(self) -> int:
        return len(self.names)

    def succs(self) -> tuple[tuple[int, ...], ...]:
        return self._succs

    @functools.cached_property
    def _succs(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in range(self.n)]
        for v, ps in enumerate(self.preds):
            for p in ps:
                out[p].append(v)
        return tuple(tuple(sorted(set(s))) for s in out)

    @functools.cached_property
    def backward_edge(self) -> tuple[int, int] | None:
        """The first edge ``(u, v)`` with ``u >= v`` (nodes out of topological order), if any."""
        return next(((p, v) for v, ps in enumerate(self.preds) for p in ps if p >= v), None)

    @functools.cached_property
    def _touching(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """Per node: the values it produces or reads, and the parameters it reads (each in
        increasing index order, once)."""
        counts, flat, _, prod = self._flat[:4]
        made = np.flatnonzero(prod >= 0)
        rflat, rparam = self._flat[5:]
        return (self._group(np.concatenate([prod[made], flat]),
                            np.concatenate([made, np.repeat(np.arange(len(counts)), counts)]),
                            len(counts)),
                self._group(rflat, rparam, len(self.param_names)))

    def _group(self, nodes: np.ndarray, items: np.ndarray, n_items: int
               ) -> tuple[tuple[int, ...], ...]:
        """Per node, the distinct ``items`` paired with it, in increasing order."""
        key = np.unique(nodes.astype(np.int64) * max(n_items, 1) + items)
        bounds = np.searchsorted(key // max(n_items, 1), np.arange(self.n + 1)).tolist()
        flat = (key % max(n_items, 1)).tolist()
        return tuple(tuple(flat[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))

    @functools.cached_property
    def _flat(self) -> tuple[np.ndarray, ...]:
        """CSR layout of consumers and readers, for vectorised evaluation."""
        counts = np.fromiter((len(c) for c in self.val_consumers), dtype=np.int64,
                             count=len(self.val_consumers))
        flat = np.fromiter((c for cs in self.val_consumers for c in cs), dtype=np.int64,
                           count=int(counts.sum()))
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        rcount = np.fromiter((len(r) for r in self.param_readers), dtype=np.int64,
                             count=len(self.param_readers))
        rflat = np.fromiter((r for rs in self.param_readers for r in rs), dtype=np.int64,
                            count=int(rcount.sum()))
        rparam = np.repeat(np.arange(len(self.param_readers)), rcount)
        return (counts, flat, starts, np.asarray(self.val_producer, dtype=np.int64),
                np.asarray(self.val_to_output, dtype=bool), rflat, rparam)

    @functools.cached_property
    def graph(self) -> nx.DiGraph:
        """The compute nodes as a ``networkx.DiGraph`` for orders, checks and cuts.

        Successors are listed in decreasing index order so every traversal (``"dfs"``)
        is deterministic; cost sums stay on the numpy arrays."""
        n = self.n
        out_bytes = [0.0] * n
        for prod, nbytes in zip(self.val_producer, self.val_bytes.tolist()):
            if prod >= 0:
                out_bytes[prod] = nbytes
        rflat, rparam = self._flat[5:]
        params = np.bincount(rflat, weights=self.param_bytes[rparam], minlength=n)
        import networkx as nx

        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        for (_, data), name, t, m, p, pin in zip(
                graph.nodes(data=True), self.names, self.time.tolist(), self.saved.tolist(),
                params.tolist(), self.pin_array().tolist()):
            data["name"], data["time"], data["memory"], data["params"], data["pin"] = (
                name, t, m, p, pin)
        graph.add_edges_from((u, v) for v in range(n - 1, -1, -1) for u in self.preds[v])
        for u, succ in graph.adjacency():
            for data in succ.values():
                data["bytes"] = out_bytes[u]
        return graph

    def pin_array(self) -> np.ndarray:
        if not self.pins:
            return np.full(self.n, -1, dtype=np.int64)
        return np.asarray(self.pins, dtype=np.int64)

    @staticmethod
    def chain(time: Values, saved: Values | None = None,
              out_bytes: Values | None = None,
              params: Values | None = None) -> DagProblem:
        """A chain ``0 -> 1 -> ... -> n-1``: node ``i``'s output is read by ``i + 1``."""
        n = len(time)
        ob = np.zeros(n) if out_bytes is None else np.asarray(out_bytes, dtype=np.float64)
        pb = np.zeros(n) if params is None else np.asarray(params, dtype=np.float64)
        return DagProblem(
            names=tuple(f"n{i}" for i in range(n)),
            time=np.asarray(time, dtype=np.float64),
            saved=np.zeros(n) if saved is None else np.asarray(saved, dtype=np.float64),
            preds=tuple(() if i == 0 else (i - 1,) for i in range(n)),
            val_producer=tuple(range(n - 1)), val_bytes=ob[: n - 1],
            val_consumers=tuple((i + 1,) for i in range(n - 1)),
            val_to_output=(False,) * (n - 1), output_inputs=(n - 1,),
            param_names=tuple(f"p{i}" for i in range(n)), param_bytes=pb,
            param_readers=tuple((i,) for i in range(n)), module_paths=("",) * n)


@dataclass(frozen=True)
class Objective:
    """The normalised stage cost; built once per (problem, config) by ``make_objective``."""

    num_stages: int
    memory_weight: float
    time_total: float
    memory_total: float
    param_factor: float
    inflight: tuple[int, ...]
    comm_time: CommTime
    link_time: CommTime
    local: tuple[bool, ...] = ()
    """Per stage (chunk): its successor runs on the same rank, so its boundary crosses no
    link (the middle of ZB-V's V). Empty: every boundary crosses one."""

    @property
    def a(self) -> float:
        return (1.0 - self.memory_weight) / self.time_total

    @property
    def b(self) -> float:
        return self.memory_weight / self.memory_total

    def crosses_no_link(self, s: int) -> bool:
        """Stage ``s`` hands its boundary to a chunk on its own rank."""
        return bool(self.local) and self.local[s]

    def link_s(self, s: int, comm_bytes: float) -> float:
        """Link occupancy of stage ``s``'s send per microbatch (the last stage sends none,
        nor does a chunk whose successor is on its own rank)."""
        if s >= self.num_stages - 1 or comm_bytes <= 0 or self.crosses_no_link(s):
            return 0.0
        return float(self.link_time(comm_bytes))

    def stage_cost(self, s: int, time_s: float, comm_bytes: float, param_bytes: float,
                   saved_bytes: float) -> float:
        mem = self.param_factor * param_bytes + saved_bytes * self.inflight[s]
        return self.a * max(time_s, self.link_s(s, comm_bytes)) + self.b * mem


def make_objective(problem: DagProblem, cfg: PartitionConfig,
                   comm_time: CommTime | None = None,
                   link_time: CommTime | None = None,
                   placement: Sequence[int] | None = None) -> Objective:
    """The objective for ``problem`` under ``cfg``: link figures from a device spec (the
    default spec's without one); ``placement`` decides which boundaries stay on a rank."""
    place = tuple(placement) if placement is not None else cfg.placement
    k = len(place)
    factor = 2.0 + cfg.optimizer_state_factor
    t_total = float(problem.time.sum()) or 1.0
    m_total = (factor * float(np.sum(problem.param_bytes))
               + float(problem.saved.sum()) * min(cfg.microbatches, cfg.active)) or 1.0
    if comm_time is None:
        comm_time, default_link = roofline.link_model(get_device(DEFAULT_DEVICE))
        link_time = link_time or default_link
    if link_time is None:
        link_time = link_occupancy(comm_time)
    local = tuple(place[c] == place[c + 1] for c in range(k - 1)) + (True,)
    peaks = (sched.chunk_peaks(cfg.schedule(place)) if place != cfg.placement
             else {s: cfg.inflight(s) for s in range(k)})
    return Objective(k, float(cfg.memory_weight), t_total, m_total, factor,
                     tuple(peaks.get(s, 0) for s in range(k)), comm_time, link_time,
                     local if any(local[:-1]) else ())


@dataclass(frozen=True)
class Evaluation:
    """Per-stage breakdown of one stage assignment under an ``Objective``."""

    time_s: np.ndarray
    comm_bytes: np.ndarray
    comm_time_s: np.ndarray
    link_time_s: np.ndarray
    param_bytes: np.ndarray
    saved_bytes: np.ndarray
    cost: np.ndarray
    shared_params: dict[str, tuple[int, ...]]

    @property
    def bottleneck(self) -> float:
        return float(self.cost.max())


def value_spans(problem: DagProblem, stage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First stage holding each value and the last stage needing it."""
    stage = np.asarray(stage, dtype=np.int64)
    out_stage = int(max((stage[i] for i in problem.output_inputs), default=stage.max()))
    counts, flat, starts, prod, to_out = problem._flat[:5]
    nv = len(counts)
    lo = np.full(nv, out_stage, dtype=np.int64)
    hi = np.full(nv, -1, dtype=np.int64)
    has = counts > 0
    if flat.size:
        cst = stage[flat]
        lo[has] = np.minimum.reduceat(cst, starts[has])
        hi[has] = np.maximum.reduceat(cst, starts[has])
    first = np.where(prod >= 0, stage[np.maximum(prod, 0)], lo)
    last = np.maximum(hi, first)
    last = np.where(to_out, np.maximum(last, out_stage), last)
    return first, last


def evaluate(problem: DagProblem, stage: Sequence[int] | np.ndarray, obj: Objective
             ) -> Evaluation:
    """Score any stage assignment (contiguous or not) with the shared objective."""
    st = np.asarray(stage, dtype=np.int64)
    k = obj.num_stages
    time_s = np.bincount(st, weights=problem.time, minlength=k)
    saved_s = np.bincount(st, weights=problem.saved, minlength=k)
    first, last = value_spans(problem, st)
    diff = np.zeros(k + 1)
    keep = last > first
    np.add.at(diff, first[keep], problem.val_bytes[keep])
    np.add.at(diff, last[keep], -problem.val_bytes[keep])
    comm_bytes = np.cumsum(diff)[:k]
    rflat, rparam = problem._flat[5:]
    pairs = np.unique(rparam * k + st[rflat])  # each (parameter, owning stage) once
    owner_param, owner_stage = pairs // k, pairs % k
    param_s = np.bincount(owner_stage, weights=problem.param_bytes[owner_param], minlength=k)
    shared: dict[str, tuple[int, ...]] = {}
    nown = np.bincount(owner_param, minlength=len(problem.param_names))
    for q in np.flatnonzero(nown > 1):
        shared[problem.param_names[q]] = tuple(int(s) for s in owner_stage[owner_param == q])
    comm_t = np.array([obj.comm_time(b) if s < k - 1 and b > 0 and not obj.crosses_no_link(s)
                       else 0.0 for s, b in enumerate(comm_bytes)])
    link_t = np.array([obj.link_s(s, b) for s, b in enumerate(comm_bytes)])
    cost = np.array([obj.stage_cost(s, time_s[s], comm_bytes[s], param_s[s], saved_s[s])
                     for s in range(k)])
    return Evaluation(time_s, comm_bytes, comm_t, link_t, param_s, saved_s, cost, shared)


@dataclass(frozen=True)
class ChainCosts:
    """A problem laid out along an order, in objective units, for ``chain.solve``; a stage
    ``[i, j)`` on stage ``s`` costs ``work + inflight[s] saved + max(time, comm[j])``."""

    work: np.ndarray
    time: np.ndarray
    saved: np.ndarray
    comm: np.ndarray

    def node_cost(self, inflight: float) -> np.ndarray:
        """Each node's cost alone on a stage with ``inflight`` microbatches, comm aside."""
        return self.work + self.time + inflight * self.saved


def chain_arrays(problem: DagProblem, order: Ints, obj: Objective,
                 replicas: bool = False) -> ChainCosts:
    """``problem`` laid out along ``order`` (a topological order) as ``ChainCosts``.

    Parameters count at their first reader; ``replicas=True`` also charges a shared one
    at its last reader (docs/partitioning.md, 'Parameters in a chain')."""
    n = problem.n
    order = np.asarray(order, dtype=np.int64)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    pmem = np.zeros(n)
    rflat, rparam = problem._flat[5:]
    if rflat.size:
        firstpos = np.full(len(problem.param_names), n, dtype=np.int64)
        np.minimum.at(firstpos, rparam, pos[rflat])
        keep = firstpos < n
        np.add.at(pmem, firstpos[keep], problem.param_bytes[keep])
        if replicas:
            lastpos = np.full(len(problem.param_names), -1, dtype=np.int64)
            np.maximum.at(lastpos, rparam, pos[rflat])
            again = keep & (lastpos > firstpos)
            np.add.at(pmem, lastpos[again], problem.param_bytes[again])
    work = obj.b * obj.param_factor * pmem
    time = obj.a * problem.time[order]
    saved = obj.b * problem.saved[order]
    first, last = value_spans(problem, pos)  # positions act as stages of a 1-node chain
    diff = np.zeros(n + 2)
    keep = last > first
    np.add.at(diff, first[keep] + 1, problem.val_bytes[keep])
    np.add.at(diff, last[keep] + 1, -problem.val_bytes[keep])
    live = np.cumsum(diff)[: n + 1]
    comm = np.zeros(n + 1)
    a, link_time = obj.a, obj.link_time
    comm[1:n] = [a * link_time(b) if b > 0 else 0.0 for b in live[1:n].tolist()]
    return ChainCosts(work, time, saved, comm)
