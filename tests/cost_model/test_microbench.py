"""``cost_model.microbench``: the timer, and the link between two real ranks."""

from __future__ import annotations

import pytest
import torch

from cost_model.microbench import QUICK, measure_link, time_per_call
from tests.helpers.dist import run_ranks


def test_time_per_call_is_the_best_repeat() -> None:
    calls: list[int] = []
    # a probe call of 1 s, so one call per repeat; repeats of 3, 1 and 2 s
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 21.0, 30.0, 32.0])
    t = time_per_call(lambda: calls.append(1), repeats=3, target_s=0.5,
                      now=lambda: next(ticks))
    assert t == 1.0 and len(calls) == 2 + 3  # a warm-up and a probe, then the repeats


def _link() -> tuple[float, float, float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return measure_link(QUICK, torch.device("cpu"))


@pytest.mark.multiproc
def test_measure_link_between_two_ranks() -> None:
    results = run_ranks(_link, 2, timeout=120)
    for latency, bandwidth, per_message in results:
        assert 0 < latency < 1.0 and bandwidth > 1e5 and 0 < per_message < 1.0
