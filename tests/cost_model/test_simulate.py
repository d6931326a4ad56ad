"""The simulator against hand-computed timelines."""

from __future__ import annotations

import pytest

from cost_model.errors import ScheduleError
from cost_model.schedule import Action, generate, parse_schedule
from cost_model.simulate import StageCost, ascii_timeline, simulate


def _spans(result, stage: int) -> list[tuple[str, float, float]]:
    return [(str(e.action), e.start_s, e.end_s) for e in result.timeline if e.stage == stage]


def test_p2_m2_simple_by_hand() -> None:
    r = simulate(generate("simple", 2, 2), [StageCost(1.0, 2.0)] * 2)
    assert _spans(r, 0) == [("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 5, 7), ("0B1", 7, 9)]
    assert _spans(r, 1) == [("1F0", 1, 2), ("1F1", 2, 3), ("1B0", 3, 5), ("1B1", 5, 7)]
    assert r.step_time_s == 9.0
    assert r.busy_s == (6.0, 6.0)
    assert r.bubble_fraction == pytest.approx(1 / 3)


def test_p2_m2_with_transfers_by_hand() -> None:
    costs = [StageCost(1.0, 2.0, send_fwd_s=0.5, send_bwd_s=0.0),
             StageCost(1.0, 2.0, send_fwd_s=0.0, send_bwd_s=0.25)]
    r = simulate(generate("simple", 2, 2), costs)
    assert _spans(r, 1) == [("1F0", 1.5, 2.5), ("1F1", 2.5, 3.5), ("1B0", 3.5, 5.5),
                            ("1B1", 5.5, 7.5)]
    assert _spans(r, 0)[2:] == [("0B0", 5.75, 7.75), ("0B1", 7.75, 9.75)]
    assert r.step_time_s == 9.75


def test_transfers_on_one_link_serialise() -> None:
    r = simulate(generate("simple", 2, 2), [StageCost(1.0, 1.0, send_fwd_s=2.0),
                                            StageCost(1.0, 1.0)])
    # 0F0's send occupies the link over [1, 3]; 0F1's waits for it: [3, 5]
    assert _spans(r, 1)[:2] == [("1F0", 3, 4), ("1F1", 5, 6)]


def test_latency_delays_arrival_but_not_the_link() -> None:
    r = simulate(generate("simple", 2, 2), [StageCost(1.0, 1.0, send_fwd_s=0.5, latency_s=3.0),
                                            StageCost(1.0, 1.0)])
    # sends occupy the link over [1, 1.5] and [2, 2.5]; each arrives 3 later
    assert _spans(r, 1)[:2] == [("1F0", 4.5, 5.5), ("1F1", 5.5, 6.5)]


@pytest.mark.parametrize("name", ["simple", "interleaved"])
def test_p4_m8_uniform_by_hand(name: str) -> None:
    p, m, f, b = 4, 8, 1.0, 2.0
    r = simulate(generate(name, p, m, active_microbatches=m), [StageCost(f, b)] * p)
    # both schedules take (m + p - 1)(f + b) with uniform stages and no transfer time
    assert r.step_time_s == (m + p - 1) * (f + b)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    last = _spans(r, p - 1)
    assert last[0] == ("3F0", 3, 4)
    if name == "interleaved":
        # 1F1B on the last stage: F0 B0 F1 B1 ... back to back from t=3
        # last stage, 1F1B: F_k over [3 + 3k, 4 + 3k], B_k over [4 + 3k, 6 + 3k]
        expected = []
        for k in range(m):
            expected += [(f"3F{k}", 3 + 3 * k, 4 + 3 * k), (f"3B{k}", 4 + 3 * k, 6 + 3 * k)]
        assert last == expected
        assert _spans(r, 0)[4] == ("0B0", 10, 12)  # 0F3 ends at 4, B0 climbs back 4..10
    else:
        assert last[8] == ("3B0", 11, 13)
        assert _spans(r, 0)[8] == ("0B0", 17, 19)


def test_peak_memory_follows_in_flight() -> None:
    p, m = 4, 8
    costs = [StageCost(1.0, 2.0, static_bytes=100, saved_bytes_per_mb=10)] * p
    inter = simulate(generate("interleaved", p, m), costs)
    assert inter.peak_in_flight == (4, 3, 2, 1)
    assert inter.peak_memory_bytes == (140, 130, 120, 110)
    simple = simulate(generate("simple", p, m, active_microbatches=m), costs)
    assert simple.peak_in_flight == (8, 8, 8, 8)
    capped = simulate(generate("simple", p, m), costs)  # SMP default cap p + 2 = 6
    assert capped.peak_in_flight == (6, 6, 6, 6)
    assert capped.step_time_s > simple.step_time_s  # two waves: a second fill and drain


def test_forward_only_and_bottleneck_stage() -> None:
    r = simulate(generate("simple", 2, 3, forward_only=True),
                 [StageCost(1.0, 0.0), StageCost(3.0, 0.0)])
    assert _spans(r, 1) == [("1F0", 1, 4), ("1F1", 4, 7), ("1F2", 7, 10)]
    assert r.peak_in_flight == (0, 0)


def test_deadlock_and_size_mismatch_raise() -> None:
    dead = parse_schedule(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"])
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(dead, [StageCost(1.0, 1.0)] * 2)
    with pytest.raises(ScheduleError, match="one StageCost per stage"):
        simulate(dead, [StageCost(1.0, 1.0)])


def test_chrome_trace_and_ascii() -> None:
    r = simulate(generate("interleaved", 2, 2), [StageCost(1.0, 2.0)] * 2)
    trace = r.chrome_trace()
    assert trace[0]["name"] == str(Action(0, "F", 0)) and trace[0]["dur"] == 1e6
    text = ascii_timeline(r, columns=24)
    assert text.splitlines()[0].startswith("stage0 |0F")
