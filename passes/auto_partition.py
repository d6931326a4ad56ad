"""``auto_partition``: the stage of every node, minimising the largest stage cost.

Several topological orders are each solved exactly as chains, refined, scored by the one
objective and the best kept, then balanced lexicographically. Pins are hard constraints;
parameters read on several stages are replicated and named in ``shared_params`` (the
runtime sums their gradients). See docs/partitioning.md, 'The solver in detail'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.fx

from cost_model.errors import SMPConfigError, SMPPartitionError
from passes import meta
from passes.in_place import colocate
from passes.partition_config import PartitionConfig
from passes.partitioning import chain
from passes.partitioning.extract import COMPUTE_OPS, problem_from_graph, write_stages
from passes.partitioning.order import ORDERS, PIN_ORDER, check_pins, topological_order
from passes.partitioning.problem import (
    DagProblem,
    Evaluation,
    Objective,
    chain_arrays,
    evaluate,
    make_objective,
)
from passes.partitioning.refine import refine

CommTime = Callable[[float], float]


@dataclass(frozen=True)
class StageCost:
    """One stage of a partition, in seconds / bytes and in objective units (``cost``).

    ``comm_time_s`` is one send (latency included); ``link_time_s`` what the objective
    weighs against ``time_s``."""

    stage: int
    nodes: tuple[str, ...]
    time_s: float
    comm_bytes: float
    comm_time_s: float
    param_bytes: float
    saved_bytes: float
    inflight: int
    memory_bytes: float
    cost: float
    link_time_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "nodes": list(self.nodes)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageCost:
        return cls(**{**data, "nodes": tuple(data["nodes"])})


@dataclass(frozen=True)
class PartitionResult:
    """Summary the plan builder reads: per-stage costs, objective, bound, shared parameters;
    ``objective / lower_bound`` bounds the distance from optimal."""

    num_stages: int
    objective: float
    lower_bound: float
    strategy: str
    stages: tuple[StageCost, ...]
    shared_params: dict[str, tuple[int, ...]]

    def to_json(self) -> dict[str, Any]:
        return {"num_stages": self.num_stages, "objective": self.objective,
                "lower_bound": self.lower_bound, "strategy": self.strategy,
                "stages": [s.to_json() for s in self.stages],
                "shared_params": {k: list(v) for k, v in self.shared_params.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartitionResult:
        return cls(data["num_stages"], data["objective"], data["lower_bound"],
                   data["strategy"], tuple(StageCost.from_json(s) for s in data["stages"]),
                   {k: tuple(v) for k, v in data["shared_params"].items()})


def problem_lower_bound(problem: DagProblem, obj: Objective) -> float:
    """max(total / k, largest node) in objective units (parameters counted once)."""
    cc = chain_arrays(problem, np.arange(problem.n), obj)
    return chain.lower_bound(cc.work, obj.num_stages, cc.saved, obj.inflight, time=cc.time)


Solved = dict[tuple[bytes, bool], chain.ChainSolution]


def _solve_order(problem: DagProblem, obj: Objective, order: np.ndarray,
                 lex: bool = False, replicas: bool = False, solved: Solved | None = None
                 ) -> np.ndarray:
    """Exact chain solve of ``problem`` laid out along ``order``; ``solved`` caches plain
    solves so the balancing pass starts from one."""
    cc = chain_arrays(problem, order, obj, replicas=replicas)
    key = (order.tobytes(), replicas)
    args = dict(saved=cc.saved, comm=cc.comm, time=cc.time, heavy=problem.heavy()[order],
                inflight=np.asarray(obj.inflight, dtype=float), pins=problem.pin_array()[order])
    if lex:
        sol = chain.solve_lex(cc.work, obj.num_stages, **args,
                              first=None if solved is None else solved.get(key))
    else:
        sol = chain.solve(cc.work, obj.num_stages, **args)
        if solved is not None:
            solved[key] = sol
    stage = np.empty(problem.n, dtype=np.int64)
    stage[order] = sol.stages(problem.n)
    return stage


def _charging(problem: DagProblem) -> tuple[bool, ...]:
    """How the chain solve charges parameters: first reader only, and for a shared parameter
    also its last reader; neither is exact for every cut, so both are solved."""
    shared = any(len(set(readers)) > 1 for readers in problem.param_readers)
    return (False, True) if shared else (False,)


def solve_problem(problem: DagProblem, obj: Objective, orders: tuple[str, ...] = ORDERS,
                  do_refine: bool = True) -> tuple[np.ndarray, str]:
    """Best stage assignment over ``orders`` (chain solve, then refinement) and its name."""
    k, n = obj.num_stages, problem.n
    if k > n:
        raise SMPPartitionError.build(
            "more partitions than compute nodes: every partition must be non-empty",
            f"partitions={k}, compute nodes={n}", "auto_partition",
            f"use at most {n} partitions, or trace with fewer leaf modules")
    check_pins(problem)
    pins = problem.pin_array()
    if np.any(pins >= 0) and PIN_ORDER not in orders:
        orders = (*orders, PIN_ORDER)
    best: tuple[float, np.ndarray, str] | None = None
    failure: SMPPartitionError | None = None
    solved: Solved = {}
    for kind, replicas in ((kind, r) for kind in orders for r in _charging(problem)):
        try:
            stage = _solve_order(problem, obj, topological_order(problem, kind),
                                 replicas=replicas)
        except SMPPartitionError as err:
            failure = failure or err
            continue
        name = f"{kind}/replicas" if replicas else kind
        value = evaluate(problem, stage, obj).bottleneck
        if do_refine:
            refined = refine(problem, obj, stage)
            refined_value = evaluate(problem, refined, obj).bottleneck
            if refined_value < value:
                stage, name, value = refined, f"{kind}+refine", refined_value
        if best is None or value < best[0]:
            best = (value, stage, name)
    if best is None:
        assert failure is not None
        raise failure
    value, stage, name = best
    for _ in range(3 if do_refine else 0):
        # stage-major order of the best plan (topological, as the plan is monotone): an exact
        # chain solve on it can only see cuts at least as good as the plan's own
        order = np.lexsort((np.arange(n), stage))
        again = min((refine(problem, obj, _solve_order(problem, obj, order, replicas=r,
                                                       solved=solved))
                     for r in _charging(problem)),
                    key=lambda st: chain.lex_key(evaluate(problem, st, obj).cost))
        new_value = evaluate(problem, again, obj).bottleneck
        if not new_value < value * (1.0 - 1e-12):
            break
        value, stage, name = new_value, again, f"{name.split('+')[0]}+resolve"
    if do_refine:
        stage = balance(problem, obj, stage, solved)
    return stage, name


def balance(problem: DagProblem, obj: Objective, stage: np.ndarray,
            solved: Solved | None = None) -> np.ndarray:
    """Lexicographic min-max on the plan's stage-major order, then refinement; kept only when
    the sorted stage costs get smaller."""
    order = np.lexsort((np.arange(problem.n), stage))
    again = min((refine(problem, obj, _solve_order(problem, obj, order, lex=True, replicas=r,
                                                   solved=solved))
                 for r in _charging(problem)),
                key=lambda st: chain.lex_key(evaluate(problem, st, obj).cost))
    if chain.lex_key(evaluate(problem, again, obj).cost) < chain.lex_key(
            evaluate(problem, stage, obj).cost):
        return again
    return stage


def summarize(problem: DagProblem, obj: Objective, stage: np.ndarray, strategy: str
              ) -> PartitionResult:
    ev: Evaluation = evaluate(problem, stage, obj)
    stages = []
    for s in range(obj.num_stages):
        nodes = tuple(problem.names[i] for i in np.flatnonzero(stage == s))
        mem = obj.param_factor * ev.param_bytes[s] + ev.saved_bytes[s] * obj.inflight[s]
        stages.append(StageCost(s, nodes, float(ev.time_s[s]), float(ev.comm_bytes[s]),
                                float(ev.comm_time_s[s]), float(ev.param_bytes[s]),
                                float(ev.saved_bytes[s]), int(obj.inflight[s]), float(mem),
                                float(ev.cost[s]), float(ev.link_time_s[s])))
    return PartitionResult(obj.num_stages, ev.bottleneck, problem_lower_bound(problem, obj),
                           strategy, tuple(stages), dict(sorted(ev.shared_params.items())))


def partition_graph(gm: torch.fx.GraphModule, pconfig: PartitionConfig,
                    comm_time: CommTime | None = None
                    ) -> tuple[torch.fx.GraphModule, PartitionResult]:
    """``auto_partition`` that also returns the ``PartitionResult`` summary."""
    problem = problem_from_graph(gm)
    if pconfig.virtual_stages > 1 and problem.n < pconfig.num_chunks:
        fits = problem.n // pconfig.num_stages
        raise SMPConfigError.build(
            f"virtual_pipeline_degree {pconfig.virtual_stages} cuts the model into "
            f"{pconfig.num_chunks} chunks, each with at least one layer",
            f"{problem.n} compute nodes", "auto_partition",
            f"set virtual_pipeline_degree to {fits} or less" if fits >= 1 else
            "lower pipeline_parallel_degree")
    obj = make_objective(problem, pconfig, comm_time)
    stage, strategy = solve_problem(problem, obj)
    kept = colocate(gm, dict(zip(problem.names, stage.tolist())))
    stage = np.asarray([kept[n] for n in problem.names], dtype=stage.dtype)
    new = write_stages(gm, kept)
    return new, summarize(problem, obj, stage, strategy)


def auto_partition(gm: torch.fx.GraphModule, pconfig: PartitionConfig,
                   comm_time: CommTime | None = None) -> torch.fx.GraphModule:
    """New GraphModule with ``STAGE`` on every node; ``gm`` is not modified.

    ``comm_time`` defaults to the default device spec's link model."""
    return partition_graph(gm, pconfig, comm_time)[0]


def evaluate_stages(gm: torch.fx.GraphModule, pconfig: PartitionConfig,
                    comm_time: CommTime | None = None, strategy: str = "given"
                    ) -> PartitionResult:
    """Score the ``STAGE`` already on ``gm`` (e.g. a manual plan) with the same objective."""
    problem = problem_from_graph(gm)
    obj = make_objective(problem, pconfig, comm_time)
    by_name = {n.name: meta.STAGE.get(n) for n in gm.graph.nodes if n.op in COMPUTE_OPS}
    missing = [k for k, v in by_name.items() if v is None]
    if missing:
        raise SMPPartitionError.build("every compute node needs a STAGE", missing[:5],
                                      "evaluate_stages",
                                      "run assign_manual or auto_partition first")
    return summarize(problem, obj, np.asarray([by_name[n] for n in problem.names]), strategy)
