"""Schedules are data: generated lists are compared exactly, and the validator catches faults."""

from __future__ import annotations

import pytest

from cost_model.errors import ScheduleError, SMPConfigError
from cost_model.schedule import (
    Action,
    clock,
    draw,
    format_schedule,
    generate,
    in_flight,
    parse_schedule,
    validate,
)


def test_action_string_round_trips() -> None:
    for text in ("0F0", "2F0", "1B3", "12B104"):
        assert str(Action.parse(text)) == text
    assert Action.parse("2F0") == Action(2, "F", 0)
    with pytest.raises(ScheduleError):
        Action.parse("2X0")
    with pytest.raises(ScheduleError):
        Action(0, "W", 1)


def test_simple_is_fill_drain_with_forward_order_backwards() -> None:
    assert format_schedule(generate("simple", 2, 3)) == [
        "0F0 0F1 0F2 0B0 0B1 0B2",
        "1F0 1F1 1F2 1B0 1B1 1B2",
    ]


def test_simple_with_active_cap_runs_waves() -> None:
    assert format_schedule(generate("simple", 2, 5, active_microbatches=2)) == [
        "0F0 0F1 0B0 0B1 0F2 0F3 0B2 0B3 0F4 0B4",
        "1F0 1F1 1B0 1B1 1F2 1F3 1B2 1B3 1F4 1B4",
    ]


def test_interleaved_is_one_f_one_b() -> None:
    assert format_schedule(generate("interleaved", 4, 6)) == [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
    ]


def test_interleaved_active_cap_limits_warmup() -> None:
    sched = generate("interleaved", 4, 6, active_microbatches=2)
    assert format_schedule(sched)[0] == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0F4 0B3 0F5 0B4 0B5"
    assert [max(in_flight(s)) for s in sched] == [2, 2, 2, 1]


@pytest.mark.parametrize("name", ["simple", "interleaved"])
def test_peak_in_flight(name: str) -> None:
    p, m = 4, 8
    peaks = [max(in_flight(s)) for s in generate(name, p, m, active_microbatches=m)]
    expected = [m] * p if name == "simple" else [min(p - s, m) for s in range(p)]
    assert peaks == expected
    # SMP's default cap, partitions + 2, binds the simple schedule when m > p + 2
    assert max(max(in_flight(s)) for s in generate(name, p, m)) <= p + 2


@pytest.mark.parametrize("name", ["simple", "interleaved"])
def test_generated_schedules_validate(name: str) -> None:
    for p in range(1, 6):
        for m in range(1, 9):
            for active in (1, 2, p + 2):
                sched = generate(name, p, m, active_microbatches=active)
                validate(sched, p, m, active_microbatches=active)
    fwd = generate(name, 3, 4, forward_only=True)
    assert format_schedule(fwd)[1] == "1F0 1F1 1F2 1F3"
    assert validate(fwd, 3, 4, forward_only=True) == 6


def test_unit_clock_lengths() -> None:
    # fill-drain: 2 (m + p - 1) ticks; 1F1B has the same length, less memory
    assert len(clock(generate("simple", 4, 8, active_microbatches=8))) == 22
    assert len(clock(generate("interleaved", 4, 8))) == 22


def test_parse_schedule_round_trips() -> None:
    sched = generate("interleaved", 3, 5)
    assert parse_schedule(format_schedule(sched)) == sched


def test_validate_reports_deadlock_with_tick() -> None:
    # backwards in another order are fine while every dependency can run first
    validate(parse_schedule(["0F0 0F1 0B1 0B0", "1F0 1B0 1F1 1B1"]), 2, 2)
    # stage 0 waits for 1B0, which stage 1 runs only after 1F1, which needs 0F1
    dead = parse_schedule(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"])
    with pytest.raises(ScheduleError, match=r"deadlocks.*clock tick 2"):
        validate(dead, 2, 2)


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (["0F0 0B0"], "one action list per stage"),
        (["0F0 0B0", "1F0 0B0"], "only that stage's actions"),
        (["0F0 0B0 0F0", "1F0 1B0"], "exactly one F and one B"),
        (["0B0 0F0", "1F0 1B0"], "after its forward"),
        (["0F0", "1F0 1B0"], "missing 0B0"),
        (["0F0 0B0 0F1 0B1", "1F0 1B0 1F1 1B1"], "microbatches 0..0"),
    ],
)
def test_validate_rejects(lines: list[str], pattern: str) -> None:
    with pytest.raises(SMPConfigError, match=pattern):
        validate(parse_schedule(lines), 2, 1)


def test_validate_rejects_in_flight_over_cap() -> None:
    with pytest.raises(ScheduleError, match="in flight"):
        validate(generate("simple", 2, 4, active_microbatches=4), 2, 4, active_microbatches=2)


def test_generate_rejects_bad_arguments() -> None:
    with pytest.raises(ScheduleError, match="must be one of"):
        generate("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="num_microbatches must be an integer >= 1"):
        generate("simple", 2, 0)
    with pytest.raises(ScheduleError, match="active_microbatches"):
        generate("simple", 2, 2, active_microbatches=0)


def test_draw_matches_docstring_table() -> None:
    assert draw(generate("interleaved", 2, 3)) == (
        "clock   0   1   2   3   4   5   6   7\n"
        "stage0  F0  F1  .   B0  F2  B1  .   B2\n"
        "stage1  .   F0  B0  F1  B1  F2  B2  ."
    )
