"""The simulator against hand-computed timelines."""

from __future__ import annotations

import pytest

from cost_model.errors import ScheduleError
from cost_model.schedule import SCHEDULE_NAMES, Action, generate, parse_schedule
from cost_model.simulate import StageCost, ascii_timeline, simulate


def _spans(result, stage: int) -> list[tuple[str, float, float]]:
    return [(str(e.action), e.start_s, e.end_s) for e in result.timeline if e.rank == stage]


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
    with pytest.raises(ScheduleError, match="one StageCost per chunk"):
        simulate(dead, [StageCost(1.0, 1.0)])


def test_chrome_trace_and_ascii() -> None:
    r = simulate(generate("interleaved", 2, 2), [StageCost(1.0, 2.0)] * 2)
    trace = r.chrome_trace()
    assert trace[0]["name"] == str(Action(0, "F", 0)) and trace[0]["dur"] == 1e6
    text = ascii_timeline(r, columns=24)
    assert text.splitlines()[0].startswith("stage0 |0F")


def _published(name: str, p: int, v: int, m: int) -> float:
    """The papers' bubble over the ideal step, with T_F = T_I = T_W (B = I + W)."""
    if name in ("simple", "interleaved"):  # GPipe, 1F1B; looped BFS, Megatron: / v
        return (p - 1) / (v * m)
    if name == "zero_bubble":  # ZB-H1 (p - 1)(T_F + T_I - T_W) over m (T_F + T_I + T_W)
        return (p - 1) / (3 * v * m)
    return 0.0  # ZB-V


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [8, 12, 16])
def test_bubble_on_unit_costs_is_the_published_formula(name: str, p: int, m: int) -> None:
    for v in ((2,) if name == "zbv" else (1, 2, 3)):
        if name in ("interleaved", "zero_bubble") and v > 1 and m % p:
            continue
        sched = generate(name, p, m, virtual_stages=v, active_microbatches=m)
        r = simulate(sched, [StageCost(1.0, 2.0, wgrad_time_s=1.0)] * (p * v))
        assert r.bubble_rate == pytest.approx(_published(name, p, v, m), abs=1e-12), (name, v)
        # the idle share of one isolated step: the rank that starts last waits p - 1
        # forwards; with nothing else idle that is (p - 1) T_F / makespan on each rank
        ideal = 3.0 * v * m
        assert r.bubble_fraction == pytest.approx(1 - ideal / r.step_time_s)


def test_bubble_ratios_that_do_not_need_equal_costs() -> None:
    # GPipe, 1F1B and Megatron's interleaving: (p - 1) / (v m) for any forward / backward
    for name, v in (("simple", 1), ("interleaved", 1), ("interleaved", 2), ("simple", 2)):
        r = simulate(generate(name, 4, 8, virtual_stages=v, active_microbatches=8),
                     [StageCost(1.0, 3.0)] * (4 * v))
        assert r.bubble_rate == pytest.approx(3 / (v * 8)), (name, v)
    # ZB-H1's formula assumes T_F = T_I = T_W; with a slower I it still beats 1F1B's
    zb = simulate(generate("zero_bubble", 4, 8), [StageCost(1.0, 3.5, wgrad_time_s=1.5)] * 4)
    one = simulate(generate("interleaved", 4, 8), [StageCost(1.0, 3.5)] * 4)
    assert zb.bubble_rate < 0.6 * one.bubble_rate


def test_split_backward_timeline_by_hand() -> None:
    # ZB-H1, p=2, m=2, F=1, I=1, W=1: rank 1 runs F0 I0 F1 I1 W0 W1 from t=1; rank 0's
    # I0 waits for rank 1's I0 (ends at 3), its W0 fills in while I1 comes back
    r = simulate(generate("zero_bubble", 2, 2), [StageCost(1.0, 2.0, wgrad_time_s=1.0)] * 2)
    assert _spans(r, 1) == [("1F0", 1, 2), ("1I0", 2, 3), ("1F1", 3, 4), ("1I1", 4, 5),
                            ("1W0", 5, 6), ("1W1", 6, 7)]
    assert _spans(r, 0) == [("0F0", 0, 1), ("0F1", 1, 2), ("0I0", 3, 4), ("0W0", 4, 5),
                            ("0I1", 5, 6), ("0W1", 6, 7)]
    assert r.step_time_s == 7.0


def test_chunks_on_one_rank_hand_over_without_the_link() -> None:
    # ZB-V, p=1: chunks 0 and 1 on rank 0; the send costs are never paid
    r = simulate(generate("zbv", 1, 1, virtual_stages=2),
                 [StageCost(1.0, 2.0, send_fwd_s=5.0, send_bwd_s=5.0, wgrad_time_s=1.0,
                            latency_s=3.0)] * 2)
    assert r.step_time_s == 6.0 and r.bubble_fraction == 0.0


def test_pending_weight_gradients_hold_their_share() -> None:
    # rank 3 of ZB-H1 p=4 runs F I F I F I F I W ...: 4 microbatches after their I hold
    # only what W reads (30 of 100 bytes), so its peak is 4 x 30 + 100 = 220, not 400
    costs = [StageCost(1.0, 2.0, wgrad_time_s=1.0, saved_bytes_per_mb=100,
                       wgrad_saved_bytes_per_mb=30, static_bytes=7)] * 4
    r = simulate(generate("zero_bubble", 4, 8), costs)
    assert r.peak_in_flight == (4, 4, 4, 4)
    assert r.peak_memory_bytes[3] == 7 + 3 * 30 + 100
    assert r.peak_memory_bytes[0] == 7 + 4 * 100  # four forwards before the first I
    # None: a pending W holds everything it was given (the safe bound)
    safe = simulate(generate("zero_bubble", 4, 8),
                    [StageCost(1.0, 2.0, wgrad_time_s=1.0, saved_bytes_per_mb=100)] * 4)
    assert safe.peak_memory_bytes == (400, 400, 400, 400)


def test_zbv_memory_matches_one_f_one_b() -> None:
    # per chunk half a rank's activations: ZB-V's 2p chunk-microbatches = 1F1B's p
    p, m = 4, 8
    one = simulate(generate("interleaved", p, m), [StageCost(2.0, 4.0, saved_bytes_per_mb=2)] * p)
    zbv = simulate(generate("zbv", p, m, virtual_stages=2),
                   [StageCost(1.0, 2.0, wgrad_time_s=1.0, saved_bytes_per_mb=1)] * (2 * p))
    assert max(zbv.peak_memory_bytes) == max(one.peak_memory_bytes) == 2 * p
    # and its step: (p - 1) forwards of fill on the last rank, then nothing idle
    assert zbv.step_time_s == (p - 1) * 1.0 + 2 * m * 3.0
    assert zbv.step_time_s / one.step_time_s < 0.8
