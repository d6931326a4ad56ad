"""Reference partitioners, scored with the same objective as ours (``problem.evaluate``).

``uniform_layers``, ``parameter_balanced`` (DeepSpeed), ``block_partition`` (torchgpipe)
and ``module_tree`` (SMP's algorithm), each made monotone so every result is a valid
pipeline plan. See docs/partitioning.md, 'The solver in detail'.
"""

from __future__ import annotations

import numpy as np

from cost_model.errors import SMPPartitionError
from passes.partitioning import chain
from passes.partitioning.problem import DagProblem, Objective, chain_arrays

BASELINES = ("uniform_layers", "parameter_balanced", "block_partition", "module_tree")


def make_monotone(problem: DagProblem, stage: np.ndarray) -> np.ndarray:
    """Raise each node (in graph order) to at least its inputs' stages: an acyclic plan."""
    st = np.array(stage, dtype=np.int64)
    for v, preds in enumerate(problem.preds):
        for p in preds:
            if st[p] > st[v]:
                st[v] = st[p]
    return st


def _equal_counts(n: int, k: int) -> np.ndarray:
    return (np.arange(n) * k) // n


def _layers(problem: DagProblem) -> tuple[str, list[str]] | None:
    """(container path, its integer-named children in execution order) or None."""
    weight: dict[str, float] = {}
    kids: dict[str, list[str]] = {}
    pmem = np.zeros(problem.n)
    for nbytes, readers in zip(problem.param_bytes, problem.param_readers):
        if readers:
            pmem[min(readers)] += nbytes
    for v, path in enumerate(problem.module_paths):
        parts = path.split(".") if path else []
        for i, part in enumerate(parts):
            if part.isdigit():
                parent = ".".join(parts[:i])
                child = ".".join(parts[: i + 1])
                weight[parent] = weight.get(parent, 0.0) + pmem[v]
                if child not in kids.setdefault(parent, []):
                    kids[parent].append(child)
    if not kids:
        return None
    best = max(kids, key=lambda p: (weight[p], p.count(".") if p else -1, p))
    return best, kids[best]


def uniform_layers(problem: DagProblem, k: int) -> np.ndarray:
    found = _layers(problem)
    n = problem.n
    if found is None or len(found[1]) < k:
        return make_monotone(problem, _equal_counts(n, k))
    _, layers = found
    stage_of = {layer: (i * k) // len(layers) for i, layer in enumerate(layers)}
    st = np.zeros(n, dtype=np.int64)
    current = 0
    for v, path in enumerate(problem.module_paths):
        for layer, s in stage_of.items():
            if path == layer or path.startswith(layer + "."):
                current = s
                break
        st[v] = current
    return make_monotone(problem, st)


def parameter_balanced(problem: DagProblem, k: int) -> np.ndarray:
    pmem = np.zeros(problem.n)
    for nbytes, readers in zip(problem.param_bytes, problem.param_readers):
        if readers:
            pmem[min(readers)] += nbytes
    sol = chain.solve(pmem, k)
    return make_monotone(problem, sol.stages(problem.n))


def block_solve(costs: np.ndarray, k: int) -> np.ndarray:
    """Stage of each element: contiguous non-empty blocks, iteratively balanced."""
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    targets = prefix[-1] * np.arange(1, k) / k
    bounds = [0, *np.searchsorted(prefix, targets, side="left").tolist(), n]
    for s in range(1, k):  # make every block non-empty
        bounds[s] = min(max(bounds[s], bounds[s - 1] + 1), n - (k - s))

    def size(s: int) -> float:
        return float(prefix[bounds[s + 1]] - prefix[bounds[s]])

    for _ in range(4 * n * k):
        sizes = [size(s) for s in range(k)]
        s = int(np.argmax(sizes))
        moved = False
        for t, edge, step in ((s - 1, s, 1), (s + 1, s + 1, -1)):
            if not 0 <= t < k or bounds[s + 1] - bounds[s] <= 1:
                continue
            bounds[edge] += step
            if max(size(s), size(t)) < sizes[s]:
                moved = True
                break
            bounds[edge] -= step
        if not moved:
            break
    return np.repeat(np.arange(k), np.diff(bounds))


def block_partition(problem: DagProblem, k: int) -> np.ndarray:
    return make_monotone(problem, block_solve(problem.time, k))


def _dhondt(costs: list[float], caps: list[int], seats: int, minimum: int = 1) -> list[int]:
    """D'Hondt: the next seat goes to the largest ``cost / (seats so far + 1)`` under its cap.

    ``minimum=0`` lets a light party win no seat at all (it then shares a neighbour's)."""
    got = [min(minimum, c) for c in caps]
    for _ in range(seats - sum(got)):
        open_ = [i for i in range(len(costs)) if got[i] < caps[i]]
        if not open_:
            break
        i = max(open_, key=lambda j: (costs[j] / (got[j] + 1), -j))
        got[i] += 1
    return got


def module_tree(problem: DagProblem, k: int, obj: Objective) -> np.ndarray:
    # a module's cost includes every parameter it holds: a tied weight counts in both
    # modules (the LM head holds a replica of the embedding), as SMP costs modules
    cc = chain_arrays(problem, np.arange(problem.n), obj, replicas=True)
    node_cost = cc.node_cost(float(np.mean(obj.inflight)))
    st = np.zeros(problem.n, dtype=np.int64)

    def children(prefix: str, members: list[int]) -> list[tuple[str, list[int]]]:
        depth = len(prefix.split(".")) if prefix else 0
        groups: dict[str, list[int]] = {}
        for v in members:
            parts = problem.module_paths[v].split(".") if problem.module_paths[v] else []
            key = ".".join(parts[: depth + 1]) if len(parts) > depth else f"#{v}"
            groups.setdefault(key, []).append(v)
        return list(groups.items())  # insertion order = first appearance = execution order

    Kids = list[tuple[str, list[int]]]

    def place(kids: Kids, first: int, devices: int) -> None:
        nodes = [v for _, m in kids for v in m]
        if devices == 1 or len(nodes) == 1:
            st[nodes] = first
            return
        if len(kids) == 1:  # a single module: descend into its children
            place(children(kids[0][0], kids[0][1]), first, devices)
            return
        costs = np.array([node_cost[m].sum() for _, m in kids])
        best = allot(kids, costs, devices)
        for segs in range(2, min(devices, len(kids)) + 1):
            bounds = [0, *chain.solve(costs, segs).cuts, len(kids)]
            groups = [kids[bounds[i]:bounds[i + 1]] for i in range(segs)]
            seg_cost = [float(costs[bounds[i]:bounds[i + 1]].sum()) for i in range(segs)]
            seats = _dhondt(seg_cost, [sum(len(m) for _, m in g) for g in groups], devices)
            score = max(c / d for c, d in zip(seg_cost, seats))
            if score < best[0] * (1.0 - 1e-12):
                best = (score, groups, seats)
        at = first
        for group, d in zip(best[1], best[2]):
            place(group, at, d)  # one device: placed; several: split this segment further
            at += d

    def allot(kids: Kids, costs: np.ndarray, devices: int
              ) -> tuple[float, list[Kids], list[int]]:
        """D'Hondt seats per child, none for a light one; (score, groups, seats).

        A seatless child rides with its neighbour (GPT's embeddings with the first block,
        the head with the last), so they hold no device of their own."""
        seats = _dhondt(list(costs), [len(m) for _, m in kids], devices, minimum=0)
        seated = [i for i, d in enumerate(seats) if d > 0]
        lead: dict[int, Kids] = {i: [] for i in seated}
        trail: dict[int, Kids] = {i: [] for i in seated}
        for i, d in enumerate(seats):
            if d == 0:
                before = [j for j in seated if j < i]
                (trail[before[-1]] if before else lead[seated[0]]).append(kids[i])
        groups: list[Kids] = []
        for i in seated:
            path, members = kids[i]
            own = [kids[i]] if seats[i] == 1 else children(path, members)
            groups.append(lead[i] + own + trail[i])
        group_cost = [float(sum(node_cost[m].sum() for _, m in g)) for g in groups]
        score = max(c / seats[i] for c, i in zip(group_cost, seated))
        return score, groups, [seats[i] for i in seated]

    place(children("", list(range(problem.n))), 0, k)
    return make_monotone(problem, st)


def run_baseline(name: str, problem: DagProblem, obj: Objective) -> np.ndarray:
    k = obj.num_stages
    if name == "uniform_layers":
        return uniform_layers(problem, k)
    if name == "parameter_balanced":
        return parameter_balanced(problem, k)
    if name == "block_partition":
        return block_partition(problem, k)
    if name == "module_tree":
        return module_tree(problem, k, obj)
    raise SMPPartitionError.build("unknown baseline", name, "run_baseline",
                                  f"use one of {BASELINES}")
