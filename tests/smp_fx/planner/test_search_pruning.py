"""The search's shortcuts change no pick: pruned by ``step_floor`` and sharing pipelines
and costed graphs, it returns what pricing every candidate returns, to the float (the
ranked plans, the counts, the smallest candidate), at ep and cp > 1 and with candidates
that do not fit; and the shared costed graph gives the profiles a fresh one gives."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cost_model.cluster import ClusterSpec, get_cluster
from smp_fx.planner.model import Prepared, Profiler
from smp_fx.planner.profile import profile
from smp_fx.planner.search import SearchResult, search
from smp_fx.planner.step import Setting

DATA = Path(__file__).resolve().parents[3] / "tests" / "data"
CLUSTER = get_cluster("dgx-h100")
GPUS, BATCH, MAX_MBS = 8, 16, 2


@pytest.fixture(scope="module")
def mixtral() -> Prepared:
    pytest.importorskip("transformers")
    from smp_fx.planner.hf_config import prepare_config

    return prepare_config(DATA / "hf_tiny_mixtral", 32)


def with_usable(cluster: ClusterSpec, usable: float) -> ClusterSpec:
    """``cluster`` with ``usable`` bytes per GPU for a plan (no reserve, no margin)."""
    device = dataclasses.replace(cluster.device, memory_bytes=int(usable))
    return dataclasses.replace(cluster, device=device, memory_reserved_bytes=0,
                               allocator_margin=0.0)


def outcome(res: SearchResult) -> tuple[object, ...]:
    smallest = res.smallest
    return (res.ranked, res.considered, res.fitting, res.refused, res.runtime_refused,
            res.what_if, smallest)


def test_pruned_search_returns_the_exhaustive_one(mixtral) -> None:
    profiler = Profiler(mixtral, CLUSTER)
    every = search(profiler, Setting(CLUSTER, GPUS, BATCH), top_k=10**6, max_mbs=MAX_MBS,
                   prune=False)
    memory = sorted(p.memory_bytes for p in every.ranked)
    assert {p.candidate.ep for p in every.ranked} >= {1, 2, 4}
    assert {p.candidate.cp for p in every.ranked} >= {1, 2}
    for usable in (CLUSTER.usable_memory_bytes, memory[len(memory) // 2], memory[0] - 1):
        setting = Setting(with_usable(CLUSTER, usable), GPUS, BATCH)
        for top_k in (1, 5):
            full = search(profiler, setting, top_k=top_k, max_mbs=MAX_MBS, prune=False)
            pruned = search(profiler, setting, top_k=top_k, max_mbs=MAX_MBS)
            assert outcome(pruned) == outcome(full)
            assert full.stepped == full.fitting
            if full.fitting > top_k:
                assert pruned.stepped < full.fitting / 2
    assert not full.ranked and full.smallest is not None  # nothing fits at the last size


def test_the_costed_graph_is_shared_without_changing_a_profile(mixtral) -> None:
    profiler = Profiler(mixtral, CLUSTER)
    for mbs in (1, 2):
        for tp, sp in ((1, False), (2, True)):
            fresh = profile(mixtral.graph, mixtral.repeats, mixtral.inputs, mbs, tp, sp,
                            CLUSTER.device, profiler.tp_comm(tp))
            assert profiler(mbs, tp, sp) == fresh
    assert profiler.priced == 4 and len(profiler._costed) == 2
