"""List-scheduled lists for placements the published constructions do not cover."""

from __future__ import annotations

import itertools

import pytest

from cost_model.schedule import format_schedule, generate, microbatches_in_flight, validate
from cost_model.schedule_greedy import greedy
from cost_model.simulate import StageCost, simulate


def test_neighbouring_chunks_on_one_rank_as_text() -> None:
    # a manual plan with contiguous pins at v = 2: ranks hold chunks (0, 1) and (2, 3)
    assert format_schedule(generate("interleaved", 2, 2, virtual_stages=2,
                                    placement=(0, 0, 1, 1))) == [
        "0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1",
        "2F0 3F0 3B0 2B0 2F1 3F1 3B1 2B1",
    ]
    assert format_schedule(generate("zero_bubble", 2, 2, virtual_stages=2,
                                    placement=(0, 0, 1, 1))) == [
        # rank 0's W's fill the wait for microbatch 1's gradients
        "0F0 1F0 0F1 1F1 1I0 0I0 1W0 0W0 1I1 0I1 1W1 0W1",
        "2F0 3F0 3I0 2I0 2F1 3F1 3I1 2I1 3W0 2W0 3W1 2W1",
    ]


@pytest.mark.parametrize("split", [False, True])
def test_any_placement_runs_and_keeps_the_cap(split: bool) -> None:
    for p, v in ((2, 2), (3, 2), (2, 3)):
        for place in sorted(set(itertools.permutations([r for r in range(p)
                                                        for _ in range(v)]))):
            for m, cap in ((1, 1), (4, 2), (5, 3)):
                sched = greedy(place, m, cap, split)
                validate(sched, p, m, num_chunks=p * v, active_microbatches=cap)
                assert max(max(microbatches_in_flight(s)) for s in sched) <= cap


def test_weight_gradients_fill_idle_time() -> None:
    # the same placement, split or not: splitting never makes the unit-cost step longer
    costs = [StageCost(1.0, 2.0, wgrad_time_s=1.0)] * 6
    for place in ((0, 0, 1, 1, 2, 2), (0, 1, 2, 2, 1, 0), (2, 0, 1, 1, 0, 2)):
        whole = simulate(greedy(place, 6, 6, split=False), costs)
        split = simulate(greedy(place, 6, 6, split=True), costs)
        assert split.step_time_s <= whole.step_time_s
