"""The closed-form schedule prices against the simulator and the papers' bubbles."""

from __future__ import annotations

import pytest

from cost_model.errors import ScheduleError
from cost_model.schedule import generate
from cost_model.schedule_cost import RankTimes, check, in_flight_at, price_schedule
from cost_model.simulate import SimResult, StageCost, simulate

GRID = [(p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 5, 6, 8, 12)]
SCHEDULE_V = [("simple", v) for v in (1, 2, 3, 4)] + [
    ("interleaved", v) for v in (1, 2, 3, 4)] + [("zero_bubble", v) for v in (1, 2, 3, 4)] + [
    ("zbv", 2)]
UNIT = {"simple": ((1.0, 1.0, 0.0), (1.0, 2.0, 0.0)),
        "interleaved": ((1.0, 1.0, 0.0), (1.0, 2.0, 0.0)),
        "zero_bubble": ((1.0, 2.0, 1.0), (1.0, 1.0, 0.0), (1.0, 2.0, 0.5), (1.0, 3.0, 1.0),
                        (2.0, 2.0, 1.0), (1.0, 2.0, 1.5), (1.0, 4.0, 2.0)),
        "zbv": ((1.0, 2.0, 1.0), (1.0, 1.0, 0.0))}
"""Per schedule, the (f, b, w) the closed form must equal the simulator at: unit costs
(F = B, or F = I = W, or W = 0), and for ZB-H1 any split (docs/planning.md)."""


def _simulated(name: str, p: int, m: int, v: int, f: float, b: float, w: float) -> SimResult:
    return simulate(generate(name, p, m, virtual_stages=v),
                    [StageCost(f / v, b / v, wgrad_time_s=w / v)] * (p * v))


@pytest.mark.parametrize("name, v", SCHEDULE_V)
def test_equal_to_the_simulator_at_unit_costs(name: str, v: int) -> None:
    covered = 0
    for p, m in GRID:
        if check(name, p, m, v) is not None:
            continue
        covered += 1
        for f, b, w in UNIT[name]:
            sim = _simulated(name, p, m, v, f, b, w)
            got = price_schedule(name, [RankTimes(f, b, w)] * p, m, v)
            where = (p, m, f, b, w)
            assert got.pipeline_s == pytest.approx(sim.step_time_s, rel=1e-12), where
            assert got.bubble_fraction == pytest.approx(sim.bubble_fraction, abs=1e-12), where
            held = [in_flight_at(name, p, m, v, r) * v for r in range(p)]
            assert held == pytest.approx(list(sim.peak_in_flight)), where
            assert got.in_flight * v == pytest.approx(sim.peak_in_flight[0]), where
    assert covered >= 8


def test_zbv_within_seven_percent_of_the_simulator_elsewhere() -> None:
    worst = 0.0
    for f, b, w in ((1.0, 2.0, 0.5), (1.0, 3.0, 1.0), (2.0, 2.0, 1.0), (1.0, 2.0, 0.0),
                    (1.0, 1.5, 0.5), (1.0, 4.0, 2.0)):
        for p, m in GRID:
            if p > 1:
                sim = _simulated("zbv", p, m, 2, f, b, w).step_time_s
                got = price_schedule("zbv", [RankTimes(f, b, w)] * p, m, 2).pipeline_s
                worst = max(worst, abs(got / sim - 1.0))
    assert 0.0 < worst <= 0.07


def test_zbv_repeats_without_a_bubble_at_equal_costs() -> None:
    p, m = 4, 12
    sim = _simulated("zbv", p, m, 2, 1.0, 2.0, 1.0)
    got = price_schedule("zbv", [RankTimes(1.0, 2.0, 1.0)] * p, m, 2)
    assert sim.bubble_rate == pytest.approx(0.0)
    assert got.pipeline_s - m * 3.0 == pytest.approx((p - 1) * 1.0 / 2)


@pytest.mark.parametrize("active", [1, 2, 3, 5])
def test_simple_waves_of_active_microbatches(active: int) -> None:
    p, m = 3, 7
    sim = simulate(generate("simple", p, m, active), [StageCost(1.0, 2.0)] * p)
    got = price_schedule("simple", [RankTimes(1.0, 2.0)] * p, m, active=active)
    assert got.pipeline_s == pytest.approx(sim.step_time_s)
    assert got.in_flight == sim.peak_in_flight[0] == min(m, active)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 4, 8])
def test_transfers_and_latency(p: int, m_per_p: int) -> None:
    m, send, latency = p * m_per_p, 0.1, 0.05
    hop = send + latency
    costs = [StageCost(1.0, 2.0, send, send, latency_s=latency)] * p
    for name in ("simple", "interleaved"):
        sim = simulate(generate(name, p, m, m), costs)
        got = price_schedule(name, [RankTimes(1.0, 2.0)] * p, m, active=m, hop_s=hop)
        assert got.pipeline_s == pytest.approx(sim.step_time_s), name


def test_transfers_when_m_is_not_a_multiple_of_p() -> None:
    hop = 0.15
    for p in (3, 4, 8):
        for m in (p - 1, p + 1, 2 * p + 3):
            costs = [StageCost(1.0, 2.0, 0.1, 0.1, latency_s=0.05)] * p
            sim = simulate(generate("interleaved", p, m), costs)
            got = price_schedule("interleaved", [RankTimes(1.0, 2.0)] * p, m, hop_s=hop)
            assert abs(got.pipeline_s - sim.step_time_s) <= 2 * hop + 1e-9, (p, m)


def test_simple_is_exact_on_stages_that_differ() -> None:
    f, b = [1.0, 1.4, 0.7], [2.0, 2.9, 1.3]
    sim = simulate(generate("simple", 3, 5), [StageCost(x, y) for x, y in zip(f, b)])
    got = price_schedule("simple", [RankTimes(x, y) for x, y in zip(f, b)], 5)
    assert got.pipeline_s == pytest.approx(sim.step_time_s)


def test_1f1b_is_an_upper_bound_close_on_stages_that_differ() -> None:
    f, b = [1.0, 1.1, 0.95, 1.05], [2.0, 2.2, 1.9, 2.1]
    sim = simulate(generate("interleaved", 4, 8), [StageCost(x, y) for x, y in zip(f, b)])
    got = price_schedule("interleaved", [RankTimes(x, y) for x, y in zip(f, b)], 8)
    assert sim.step_time_s <= got.pipeline_s <= 1.065 * sim.step_time_s


def _bubble_time(name: str, p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    cost = price_schedule(name, [RankTimes(f, b, w)] * p, m, v)
    return cost.pipeline_s - m * (f + b)


def test_published_bubbles() -> None:
    p, m = 8, 16
    one_f_one_b = _bubble_time("interleaved", p, m, 1, 1.0, 2.0, 1.0)
    assert one_f_one_b == pytest.approx((p - 1) * 3.0)
    # Megatron's interleaving: bubble (p - 1) / (v m) of the ideal step
    for v in (2, 4):
        assert _bubble_time("interleaved", p, m, v, 1.0, 2.0, 1.0) == pytest.approx(
            one_f_one_b / v)
    # looped BFS: the same bubble when m >= p (one wave: active = m)
    bfs = price_schedule("simple", [RankTimes(1.0, 2.0)] * p, m, 2, active=m)
    assert bfs.pipeline_s - m * 3.0 == pytest.approx(one_f_one_b / 2)
    # ZB-H1 at T_F = T_B(input) = T_W: a third of 1F1B's bubble; ZB-V: half a forward
    # per hop of fill, a sixth (none back to back: test_zbv_repeats_without_a_bubble...)
    assert _bubble_time("zero_bubble", p, m, 1, 1.0, 2.0, 1.0) == pytest.approx(
        one_f_one_b / 3)
    assert _bubble_time("zbv", p, m, 2, 1.0, 2.0, 1.0) == pytest.approx(one_f_one_b / 6)
    # without a weight gradient to defer, zero bubble is 1F1B (v = 1) or interleaving
    assert _bubble_time("zero_bubble", p, m, 1, 1.0, 2.0, 0.0) == pytest.approx(one_f_one_b)


def test_memory_in_flight() -> None:
    p, m = 4, 8
    assert in_flight_at("simple", p, m, 1, 0) == min(m, p + 2)
    assert [in_flight_at("zero_bubble", p, m, 1, r) for r in range(p)] == [p] * p
    assert in_flight_at("zbv", p, m, 2, 3) == p
    assert [in_flight_at("zbv", p, 2, 2, r) for r in range(p)] == [1.5, 2, 2, 2]
    # Megatron: 2 (p - 1) + (v - 1) p + 1 chunk-microbatches on rank 0, each 1/v of a stage
    assert in_flight_at("interleaved", p, m, 2, 0) == pytest.approx((6 + 4 + 1) / 2)
    assert in_flight_at("simple", p, m, 2, 0) == min(m, p + 2)


def test_what_the_formulas_do_not_cover_is_an_error() -> None:
    assert check("zbv", 4, 8, 1) is not None
    assert check("interleaved", 4, 6, 2) is not None  # m a multiple of p
    assert check("interleaved", 1, 6, 2) is not None
    assert check("pipedream", 4, 8, 1) is not None
    with pytest.raises(ScheduleError, match="multiple of p"):
        price_schedule("interleaved", [RankTimes(1.0, 2.0)] * 4, 6, v=2)
