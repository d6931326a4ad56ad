"""Cutting a model's parts into pipeline chunks, and each rank's share."""

from __future__ import annotations

import itertools

import pytest

from cost_model.devices import get_device
from smp_fx.planner.model import Profiler, prepare
from smp_fx.planner.stages import chunk_ranks, rank_loads, split_layers
from tests.smp_fx.planner.conftest import gpt_inputs, link_cluster, tiny_gpt


def _brute(head: float, first: float, layer: float, tail: float, n: int, k: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(n + 1), k - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, n))]
        if any(c == 0 for c in counts[1:-1]):
            continue  # middle chunks hold a layer
        times, start = [], 0
        for i, c in enumerate(counts):
            t = (head if i == 0 else 0) + (tail if i == k - 1 else 0)
            t += (first + (c - 1) * layer if start == 0 else c * layer) if c else 0
            times.append(t)
            start += c
        best = min(best, max(times))
    return best


@pytest.mark.parametrize("head, tail", [(0.1, 0.2), (0.0, 1.5), (2.5, 0.3), (0.7, 0.7)])
@pytest.mark.parametrize("n, k", [(4, 2), (6, 3), (8, 4), (9, 4), (7, 7), (12, 5)])
def test_split_is_the_exact_minimum(head: float, tail: float, n: int, k: int) -> None:
    counts = split_layers(head, 1.2, 1.0, tail, n, k)
    assert sum(counts) == n and len(counts) == k
    times, start = [], 0
    for i, c in enumerate(counts):
        t = (head if i == 0 else 0) + (tail if i == k - 1 else 0)
        t += (1.2 + (c - 1) * 1.0 if start == 0 else c * 1.0) if c else 0
        times.append(t)
        start += c
    assert max(times) == pytest.approx(_brute(head, 1.2, 1.0, tail, n, k))


def test_chunk_placement() -> None:
    assert chunk_ranks(3, 1, "interleaved") == [0, 1, 2]
    assert chunk_ranks(3, 2, "interleaved") == [0, 1, 2, 0, 1, 2]
    assert chunk_ranks(3, 2, "zbv") == [0, 1, 2, 2, 1, 0]


def test_rank_loads_sum_to_the_model() -> None:
    prof = Profiler(prepare(tiny_gpt(8), gpt_inputs), link_cluster())(2, 1, False)
    spec = get_device("a100")
    whole = rank_loads(prof, "none", 1, 1, "interleaved", spec)
    assert whole is not None
    for pp, v, sched in ((2, 1, "simple"), (4, 1, "interleaved"), (2, 2, "interleaved"),
                         (2, 2, "zbv")):
        ranks = rank_loads(prof, "none", pp, v, sched, spec)
        assert ranks is not None
        assert sum(ranks.layers) == 8
        assert sum(ranks.kept) == whole.kept[0]
        assert sum(ranks.flops) == pytest.approx(whole.flops[0])
        # the tied embedding is held by the first and the last rank
        shared = [dict(s) for s in ranks.shared]
        assert "wte.weight" in shared[0] and "wte.weight" in shared[-1 if sched != "zbv" else 0]
        assert len(ranks.hops) == pp * v - 1
    assert rank_loads(prof, "none", 4, 4, "interleaved", spec) is None  # 16 chunks, 8 layers


def test_megatron_cores_split_gives_every_chunk_the_same_layers() -> None:
    """Megatron-Core builds n / (pp x vp) layers per chunk whatever the head and tail
    weigh (get_num_layers_to_build), and does not run a split that leaves a remainder."""
    prof = Profiler(prepare(tiny_gpt(8), gpt_inputs), link_cluster())(2, 1, False)
    spec = get_device("a100")
    for pp, v, sched in ((2, 1, "interleaved"), (4, 1, "interleaved"), (2, 2, "interleaved"),
                         (2, 2, "zbv"), (8, 1, "interleaved")):
        ranks = rank_loads(prof, "none", pp, v, sched, spec, even=True)
        assert ranks is not None and ranks.layers == (8 // pp,) * pp
    for pp, v in ((3, 1), (2, 3), (4, 4)):
        assert rank_loads(prof, "none", pp, v, "interleaved", spec, even=True) is None


def test_megatron_cores_split_can_count_the_embedding_and_the_loss_as_layers() -> None:
    """With ``account_for_embedding_in_pipeline_split`` and ``..._loss_...`` Megatron-Core
    splits n + 2 evenly and the first and last chunks build one layer fewer: 8 layers
    on 5 chunks (1, 2, 2, 2, 1), on 10 chunks the ends none; 8 chunks do not divide 10."""
    prof = Profiler(prepare(tiny_gpt(8), gpt_inputs), link_cluster())(2, 1, False)
    spec = get_device("a100")
    ranks = rank_loads(prof, "none", 5, 1, "interleaved", spec, even=True, ends=True)
    assert ranks is not None and ranks.layers == (1, 2, 2, 2, 1)
    plain = rank_loads(prof, "none", 4, 1, "interleaved", spec, even=True)
    assert plain is not None
    ends = rank_loads(prof, "none", 2, 5, "interleaved", spec, even=True, ends=True)
    assert ends is not None and sum(ends.layers) == 8
    assert sum(ends.flops) == pytest.approx(sum(plain.flops))  # the same model, cut elsewhere
    assert rank_loads(prof, "none", 8, 1, "interleaved", spec, even=True, ends=True) is None
    assert rank_loads(prof, "none", 5, 1, "interleaved", spec, even=True) is None


def test_recomputed_layers_share_the_causal_mask_they_keep() -> None:
    pytest.importorskip("transformers")
    from pathlib import Path

    from smp_fx.planner.hf_config import prepare_config

    seq = 256
    llama = Path(__file__).resolve().parents[2] / "data" / "hf_tiny_llama"
    prof = Profiler(prepare_config(llama, seq), link_cluster())(1, 1, False)
    relay = prof.relay_bytes
    assert min(p.saved_full for p in prof.parts[1:3]) > relay >= seq * seq  # the s x s mask
    each = sum(u.kept("full")[0] for u in prof.units())  # every layer its own copy
    for pp in (1, 2):
        ranks = rank_loads(prof, "full", pp, 1, "simple", get_device("h100"))
        assert ranks is not None and sum(ranks.layers) == 4
        assert sum(ranks.kept) == each - (4 - pp) * relay  # one copy per rank
