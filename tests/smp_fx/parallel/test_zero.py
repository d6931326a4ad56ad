"""Owner assignment of optimizer-state sharding (the multi-process behaviour is in
``test_sharding_dist.py``)."""

from __future__ import annotations

import random

from smp_fx.parallel.zero import assign_owners


def test_every_rank_holds_a_dp_th_within_one_parameter() -> None:
    rng = random.Random(0)
    for n in (2, 3, 4, 8):
        sizes = [rng.choice([1, 7, 64, 300, 4096]) for _ in range(rng.randint(n, 60))]
        owner = assign_owners(sizes, n)
        loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(n)]
        assert all(abs(load - sum(sizes) / n) <= max(sizes) for load in loads), (n, loads)
        assert owner == assign_owners(list(sizes), n)  # deterministic: every rank agrees


def test_fewer_parameters_than_ranks() -> None:
    assert assign_owners([5], 4) == [0]
    assert assign_owners([], 2) == []
