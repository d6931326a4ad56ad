"""Synthetic partitioning problems for tests and benchmarks (seeded, deterministic):
random chains, a GPT-like DAG with a tied head, layered random DAGs.
"""

from __future__ import annotations

import numpy as np

from cost_model.errors import SMPPartitionError
from passes.partitioning.problem import DagProblem

CHAIN_KINDS = ("uniform", "embedding_blocks_head", "heavy_tailed")


def random_chain(n: int, kind: str, rng: np.random.Generator) -> DagProblem:
    if kind == "uniform":
        time = rng.uniform(0.5, 1.5, n)
        params = rng.uniform(0.5, 1.5, n) * 1e6
    elif kind == "embedding_blocks_head":
        time = np.ones(n)
        params = np.full(n, 1e6)
        time[0], params[0] = 0.2, 0.25 * n * 1e6
        time[-1], params[-1] = 0.1 * n, 0.25 * n * 1e6
    elif kind == "heavy_tailed":
        time = rng.pareto(1.2, n) + 0.01
        params = (rng.pareto(1.2, n) + 0.01) * 1e6
    else:
        raise SMPPartitionError.build("unknown chain kind", kind, "random_chain",
                                      f"use {CHAIN_KINDS}")
    saved = rng.uniform(0.2, 1.0, n) * 1e5
    out = rng.uniform(0.5, 1.5, n) * 1e5
    return DagProblem.chain(time * 1e-3, saved, out, params)


def _problem(names: list[str], paths: list[str], time: list[float], saved: list[float],
             preds: list[tuple[int, ...]], out_bytes: list[float],
             params: dict[str, tuple[float, tuple[int, ...]]], pins: list[int] | None = None
             ) -> DagProblem:
    n = len(names)
    consumers: list[list[int]] = [[] for _ in range(n)]
    for v, ps in enumerate(preds):
        for p in ps:
            consumers[p].append(v)
    vals = [v for v in range(n) if consumers[v] or v == n - 1]
    pnames = sorted(params)
    return DagProblem(
        names=tuple(names), time=np.asarray(time), saved=np.asarray(saved),
        preds=tuple(tuple(sorted(set(p))) for p in preds),
        val_producer=tuple(vals), val_bytes=np.asarray([out_bytes[v] for v in vals]),
        val_consumers=tuple(tuple(sorted(set(consumers[v]))) for v in vals),
        val_to_output=tuple(v == n - 1 for v in vals), output_inputs=(n - 1,),
        param_names=tuple(pnames), param_bytes=np.asarray([params[p][0] for p in pnames]),
        param_readers=tuple(params[p][1] for p in pnames), module_paths=tuple(paths),
        pins=tuple(pins) if pins else ())


def transformer_dag(layers: int, d: int = 1024, seq: int = 1024, vocab: int = 50257,
                    tied: bool = True) -> DagProblem:
    """GPT-like graph with analytic-ish costs (fp32 bytes, 100 TFLOP/s)."""
    names: list[str] = []
    paths: list[str] = []
    time: list[float] = []
    saved: list[float] = []
    preds: list[tuple[int, ...]] = []
    out: list[float] = []
    params: dict[str, tuple[float, tuple[int, ...]]] = {}
    act = 4.0 * seq * d

    def add(name: str, path: str, flops: float, inputs: tuple[int, ...], nbytes: float,
            pbytes: float = 0.0, pname: str | None = None) -> int:
        names.append(name)
        paths.append(path)
        time.append(3 * flops / 1e14 + 1e-6)
        saved.append(nbytes)
        preds.append(inputs)
        out.append(nbytes)
        if pbytes:
            key = pname or f"{path}.weight"
            prev = params.get(key, (pbytes, ()))
            params[key] = (pbytes, (*prev[1], len(names) - 1))
        return len(names) - 1

    x = add("emb", "emb", seq * d, (), act, 4.0 * vocab * d, "emb.weight")
    for i in range(layers):
        p = f"blocks.{i}"
        ln = add(f"ln1_{i}", f"{p}.ln1", 5 * seq * d, (x,), act, 8.0 * d)
        q = add(f"q_{i}", f"{p}.attn.q", 2 * seq * d * d, (ln,), act, 4.0 * d * d)
        k = add(f"k_{i}", f"{p}.attn.k", 2 * seq * d * d, (ln,), act, 4.0 * d * d)
        v = add(f"v_{i}", f"{p}.attn.v", 2 * seq * d * d, (ln,), act, 4.0 * d * d)
        a = add(f"sdpa_{i}", f"{p}.attn", 4 * seq * seq * d, (q, k, v), act)
        o = add(f"o_{i}", f"{p}.attn.o", 2 * seq * d * d, (a,), act, 4.0 * d * d)
        r = add(f"res1_{i}", p, seq * d, (x, o), act)
        ln2 = add(f"ln2_{i}", f"{p}.ln2", 5 * seq * d, (r,), act, 8.0 * d)
        h = add(f"fc1_{i}", f"{p}.mlp.fc1", 8 * seq * d * d, (ln2,), 4 * act, 16.0 * d * d)
        g = add(f"gelu_{i}", f"{p}.mlp", 8 * seq * d, (h,), 4 * act)
        f = add(f"fc2_{i}", f"{p}.mlp.fc2", 8 * seq * d * d, (g,), act, 16.0 * d * d)
        x = add(f"res2_{i}", p, seq * d, (r, f), act)
    x = add("norm", "norm", 5 * seq * d, (x,), act, 8.0 * d)
    add("head", "" if tied else "head", 2 * seq * d * vocab, (x,), 4.0 * seq * vocab,
        4.0 * vocab * d, "emb.weight" if tied else "head.weight")
    return _problem(names, paths, time, saved, preds, out, params)


def random_dag(n: int, rng: np.random.Generator, width: int = 4, skip: float = 0.1
               ) -> DagProblem:
    """Nodes in layers of up to ``width``; each reads 1-2 nodes of the previous layer and,
    with probability ``skip``, one older node; costs heavy-tailed."""
    layer_of: list[list[int]] = []
    preds: list[tuple[int, ...]] = []
    while len(preds) < n:
        size = min(int(rng.integers(1, width + 1)), n - len(preds))
        here = []
        for _ in range(size):
            v = len(preds)
            ps: set[int] = set()
            if layer_of:
                prev = layer_of[-1]
                ps.update(int(u) for u in rng.choice(prev, size=min(len(prev), 2)))
                if v > 2 and rng.random() < skip:
                    ps.add(int(rng.integers(0, v - 1)))
            preds.append(tuple(sorted(ps)))
            here.append(v)
        layer_of.append(here)
    last = n - 1
    used = {u for p in preds for u in p}
    ends = [v for v in range(n - 1) if v not in used]
    preds[last] = tuple(sorted(set(preds[last]) | set(ends)))
    time = (rng.pareto(1.5, n) + 0.1) * 1e-3
    out = rng.uniform(0.1, 1.0, n) * 1e6
    params: dict[str, tuple[float, tuple[int, ...]]] = {
        f"p{v}": (float(rng.pareto(1.5) * 1e6), (v,)) for v in range(n) if rng.random() < 0.6}
    paths = [f"layers.{i}" for i, layer in enumerate(layer_of) for _ in layer]
    return _problem([f"n{v}" for v in range(n)], paths, list(time), list(out * 0.5),
                    preds, list(out), params)
