"""``manual_chunks``: a manual partition cut into chunks when a rank holds several.

Pins name ranks, as in SMP; runs of consecutive modules on one rank become chunks (a
rank's costliest run cut in two until it has v), placed as the pins dictate.
See docs/schedules.md, 'Manual partitions with several chunks per rank'.
"""

from __future__ import annotations

import torch.fx

from cost_model.errors import SMPConfigError, SMPPartitionError
from passes import meta
from passes.graph_utils import copy_graph_module
from passes.partitioning.extract import COMPUTE_OPS


def _cost(n: torch.fx.Node) -> float:
    cost = meta.COST.get(n) if meta.COST.has(n) else None
    return 0.0 if cost is None else float(cost.fwd_time_s + cost.bwd_time_s)


def _split(run: list[torch.fx.Node]) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """Two non-empty pieces of ``run`` with forward + backward time as even as possible."""
    total = sum(_cost(n) for n in run)
    best, best_gap, acc = 1, float("inf"), 0.0
    for i in range(1, len(run)):
        acc += _cost(run[i - 1])
        gap = abs(total - 2 * acc)
        if gap < best_gap:
            best, best_gap = i, gap
    return run[:best], run[best:]


def manual_chunks(gm: torch.fx.GraphModule, num_ranks: int, virtual: int
                  ) -> tuple[torch.fx.GraphModule, tuple[int, ...]]:
    """A copy of ``gm`` (``STAGE`` = rank, from ``assign_manual``) with ``STAGE`` = chunk,
    and the placement: the rank of every chunk."""
    new = copy_graph_module(gm)
    nodes = list(new.graph.nodes)
    runs: list[tuple[int, list[torch.fx.Node]]] = []
    for n in nodes:
        if n.op in COMPUTE_OPS and meta.PIN.has(n):
            rank = int(meta.PIN.get(n))
            if not runs or runs[-1][0] != rank:
                runs.append((rank, []))
            runs[-1][1].append(n)
    pieces: dict[int, list[list[torch.fx.Node]]] = {r: [] for r in range(num_ranks)}
    for rank, members in runs:
        pieces[rank].append(members)
    for rank, mine in pieces.items():
        if not mine:
            raise SMPPartitionError.build(
                "every pipeline rank holds a module when a manual partition is cut into "
                "chunks", f"rank {rank}: no module pinned to it", "manual partition",
                f"pin a module to partition {rank} (smp.partition / smp.set_partition), or "
                f"lower pipeline_parallel_degree to {num_ranks - 1}")
        while len(mine) < virtual:
            splittable = [run for run in mine if len(run) > 1]
            if not splittable:
                raise SMPConfigError.build(
                    f"virtual_pipeline_degree {virtual} needs {virtual} chunks on each rank, "
                    f"each with at least one layer", f"rank {rank}: {sum(map(len, mine))} "
                    "layer node(s)", "manual partition",
                    "lower virtual_pipeline_degree or give the rank more modules")
            run = max(splittable, key=lambda r: (sum(_cost(n) for n in r), -mine.index(r)))
            at = mine.index(run)
            mine[at:at + 1] = list(_split(run))
    order = sorted((run for mine in pieces.values() for run in mine),
                   key=lambda run: nodes.index(run[0]))
    placement = tuple(next(r for r, mine in pieces.items() if run in mine) for run in order)
    chunk_of = {n: c for c, run in enumerate(order) for n in run}
    for n in nodes:
        if n in chunk_of:
            meta.STAGE.set(n, chunk_of[n])
        elif n.op in COMPUTE_OPS:  # glue: the latest chunk among its inputs
            ins = [chunk_of[a] for a in n.all_input_nodes if a in chunk_of]
            if ins:
                chunk_of[n] = max(ins)
                meta.STAGE.set(n, chunk_of[n])
    for n in reversed(nodes):  # the rest: their earliest user (the output: latest input)
        if n in chunk_of or n.op == "output":
            continue
        users = [chunk_of[u] for u in n.users if u in chunk_of]
        chunk_of[n] = min(users, default=0)
        meta.STAGE.set(n, chunk_of[n])
    out = next(n for n in nodes if n.op == "output")
    meta.STAGE.set(out, max((chunk_of[a] for a in out.all_input_nodes if a in chunk_of),
                            default=len(order) - 1))
    return new, placement


__all__ = ["manual_chunks"]
