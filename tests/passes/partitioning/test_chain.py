"""The chain solver is exact: compare with brute force over every set of cuts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cost_model.errors import SMPPartitionError
from passes.partitioning.chain import lower_bound, solve, stage_costs


def brute_force(work: np.ndarray, k: int, saved: np.ndarray, comm: np.ndarray,
                inflight: np.ndarray, pins: np.ndarray) -> float:
    n = len(work)
    best = np.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        st = np.zeros(n, dtype=int)
        for c in cuts:
            st[c:] += 1
        if np.any((pins >= 0) & (pins != st)):
            continue
        best = min(best, float(stage_costs(cuts, work, saved, comm, inflight).max()))
    return best


def test_matches_brute_force_on_random_chains() -> None:
    rng = np.random.default_rng(1)
    checked = 0
    for trial in range(300):
        n = int(rng.integers(1, 10))
        k = int(rng.integers(1, n + 1))
        tail = rng.pareto(1.5, n) if trial % 2 else rng.random(n)
        work = tail * (rng.random(n) < 0.85)
        saved = rng.random(n) * (trial % 3 == 0)
        comm = np.concatenate([[0.0], rng.random(n) * 0.5])
        inflight = rng.integers(1, 5, size=k).astype(float)
        pins = np.full(n, -1)
        if trial % 4 == 0:
            pins[int(rng.integers(0, n))] = int(rng.integers(0, k))
        ref = brute_force(work, k, saved, comm, inflight, pins)
        if not np.isfinite(ref):
            with pytest.raises(SMPPartitionError):
                solve(work, k, saved=saved, comm=comm, inflight=inflight, pins=pins)
            continue
        sol = solve(work, k, saved=saved, comm=comm, inflight=inflight, pins=pins)
        assert sol.bottleneck == pytest.approx(ref, rel=1e-9, abs=1e-15)
        assert len(sol.cuts) == k - 1 and list(sol.cuts) == sorted(set(sol.cuts))
        st = sol.stages(n)
        assert np.all((pins < 0) | (pins == st))
        assert lower_bound(work, k, saved, inflight) <= sol.bottleneck * (1 + 1e-12)
        assert lower_bound(work, k, saved, inflight, comm) <= sol.bottleneck * (1 + 1e-12)
        checked += 1
    assert checked > 200


def test_comm_moves_the_cut_to_a_cheap_boundary() -> None:
    # equal work; cutting after node 2 sends little, after node 1 (the balanced cut) a lot
    work = [1.0, 1.0, 1.0, 1.0]
    assert solve(work, 2).cuts == (2,)
    assert solve(work, 2, comm=[0.1, 5.0, 0.1]).cuts in {(1,), (3,)}


def test_inflight_weights_saved_memory_per_stage() -> None:
    # interleaved-like in-flight counts: the first stage holds 4x the activations
    saved = [1.0] * 10
    sol = solve([0.0] * 10, 2, saved=saved, inflight=[4.0, 1.0])
    assert sol.cuts == (2,)
    assert sol.bottleneck == pytest.approx(8.0)


def test_errors_and_determinism() -> None:
    with pytest.raises(SMPPartitionError, match="n=3, k=4"):
        solve([1.0, 2.0, 3.0], 4)
    with pytest.raises(SMPPartitionError, match="pinned"):
        solve([1.0, 2.0, 3.0], 2, pins=[1, 0, -1])
    rng = np.random.default_rng(7)
    work = rng.random(500)
    comm = rng.random(499)
    assert solve(work, 16, comm=comm) == solve(work.copy(), 16, comm=comm.copy())


def test_large_chain_is_optimal_against_dp() -> None:
    rng = np.random.default_rng(3)
    n, k = 60, 5
    work, comm = rng.random(n), np.concatenate([[0.0], rng.random(n) * 0.3])
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    best = np.full((k + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    for s in range(1, k + 1):
        for j in range(s, n + 1):
            c = comm[j] if j < n else 0.0
            best[s, j] = min(max(best[s - 1, i], prefix[j] - prefix[i] + c)
                             for i in range(s - 1, j))
    assert solve(work, k, comm=comm).bottleneck == pytest.approx(best[k, n], rel=1e-9)
