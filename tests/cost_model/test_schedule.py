"""Schedules are data: generated lists are compared exactly, and the validator catches faults.

The published schedules' bubbles on unit costs are checked in test_simulate.py.
"""

from __future__ import annotations

import pytest

from cost_model.errors import ScheduleError, SMPConfigError
from cost_model.schedule import (
    SCHEDULE_NAMES,
    Action,
    clock,
    draw,
    format_schedule,
    generate,
    in_flight,
    microbatches_in_flight,
    parse_schedule,
    placement_of,
    round_robin,
    v_shape,
    validate,
)


def test_action_string_round_trips() -> None:
    for text in ("0F0", "2F0", "1B3", "12B104", "5I3", "7W0"):
        assert str(Action.parse(text)) == text
    assert Action.parse("2F0") == Action(2, "F", 0)
    assert Action.parse("3W1").chunk == 3
    with pytest.raises(ScheduleError):
        Action.parse("2X0")
    with pytest.raises(ScheduleError):
        Action(0, "X", 1)


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
        (["0F0 0B0"], "one action list per rank"),
        (["0F0 0B0", "1F0 0B0"], "each chunk runs on one rank"),
        (["0F0 0B0 0F0", "1F0 1B0"], "exactly one F and one B"),
        (["0F0 0I0 0B0", "1F0 1B0"], "one B, or one I and one W"),
        (["0F0 0W0 0I0", "1F0 1B0"], "after its input gradient"),
        (["0F0 0I0", "1F0 1B0"], "missing 0W0"),
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
    with pytest.raises(ScheduleError, match="exactly two chunks per rank"):
        generate("zbv", 2, 4, virtual_stages=3)
    with pytest.raises(ScheduleError, match="virtual_pipeline_degree must be an integer"):
        generate("simple", 2, 4, virtual_stages=0)
    with pytest.raises(ScheduleError, match="each of the 2 ranks at least one chunk"):
        generate("simple", 2, 4, virtual_stages=2, placement=(0, 0, 0, 0))
    with pytest.raises(ScheduleError, match="'zbv' runs on the V placement"):
        generate("zbv", 2, 4, virtual_stages=2, placement=(0, 1, 0, 0))
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


def test_placements() -> None:
    assert round_robin(3, 2) == (0, 1, 2, 0, 1, 2)
    assert v_shape(3) == (0, 1, 2, 2, 1, 0)
    assert placement_of(generate("zbv", 3, 4, virtual_stages=2)) == v_shape(3)
    assert placement_of(generate("interleaved", 2, 4, virtual_stages=3)) == round_robin(2, 3)


def test_looped_bfs_runs_chunk_by_chunk() -> None:
    # simple at v = 2: every forward of the rank's first chunk, then of its second; the
    # backwards chunk by chunk in reverse, microbatches in forward order
    assert format_schedule(generate("simple", 2, 2, virtual_stages=2)) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1",
    ]
    # waves of active_microbatches, each a whole looped BFS
    assert format_schedule(generate("simple", 2, 3, active_microbatches=2,
                                    virtual_stages=2))[1] == (
        "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1 1F2 3F2 3B2 1B2")


def test_megatron_interleaved_groups_of_p() -> None:
    # microbatches pass in groups of p = 2 through chunk 0 then chunk 1 (2 on rank 0);
    # rank 0 warms up with (v - 1) p + 2 (p - 1) + 1 = 5 forwards, rank 1 with 3
    assert format_schedule(generate("interleaved", 2, 4, virtual_stages=2)) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_zb_h1_keeps_weight_gradients_back() -> None:
    # 1F1B's warm-up and I where 1F1B has B; rank r keeps r W's back for the drain, so
    # every rank holds p microbatches at its peak, as 1F1B's first rank does
    sched = generate("zero_bubble", 4, 6)
    assert format_schedule(sched) == [
        "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5",
        "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1I4 1W3 1I5 1W4 1W5",
        "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2I5 2W3 2W4 2W5",
        "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3W3 3W4 3W5",
    ]
    assert [max(in_flight(s)) for s in sched] == [4, 4, 4, 4]
    # a cap shortens the warm-up and the W's kept back
    capped = generate("zero_bubble", 4, 6, active_microbatches=2)
    assert [max(microbatches_in_flight(s)) for s in capped] == [2, 2, 2, 2]
    validate(capped, 4, 6, active_microbatches=2)


def test_interleaved_zero_bubble() -> None:
    assert format_schedule(generate("zero_bubble", 2, 4, virtual_stages=2)) == [
        "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 "
        "0I2 0W2 0I3 0W3",
        "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 "
        "3W3 1I3 1W2 1W3",
    ]


def test_zbv_runs_down_and_up_the_v() -> None:
    sched = generate("zbv", 2, 4, virtual_stages=2)
    assert format_schedule(sched) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 "
        "0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 "
        "1I3 1W2 2W3 1W3",
    ]
    # 1F1B's activation memory: at most 2p chunk activations (p whole-rank microbatches)
    big = generate("zbv", 4, 8, virtual_stages=2)
    assert [max(in_flight(s)) for s in big] == [8, 8, 8, 8]
    # fewer microbatches than 2p - 1: the same pattern with the missing ones left out
    assert format_schedule(generate("zbv", 3, 1, virtual_stages=2)) == [
        "0F0 5F0 5I0 5W0 0I0 0W0", "1F0 4F0 4I0 4W0 1I0 1W0", "2F0 3F0 3I0 3W0 2I0 2W0"]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_new_schedule_validates(name: str) -> None:
    for p in range(1, 6):
        for v in ((2,) if name == "zbv" else (1, 2, 3)):
            for m in range(1, 11):
                if name in ("interleaved", "zero_bubble") and v > 1 and m % p:
                    continue
                sched = generate(name, p, m, virtual_stages=v, active_microbatches=m)
                validate(sched, p, m, num_chunks=p * v, active_microbatches=m)
                fwd = generate(name, p, m, virtual_stages=v, forward_only=True)
                validate(fwd, p, m, forward_only=True, num_chunks=p * v)


def test_microbatches_the_interleaving_cannot_take() -> None:
    with pytest.raises(SMPConfigError, match=r"multiple of it \(got 6\).*set microbatches to 4 "
                       r"or 8"):
        generate("interleaved", 4, 6, virtual_stages=2)
    with pytest.raises(SMPConfigError, match="set microbatches to 4"):
        generate("zero_bubble", 4, 3, virtual_stages=2)


def test_active_cap_below_a_fixed_warmup_is_refused() -> None:
    with pytest.raises(SMPConfigError, match="holds 8 microbatches on rank 0.*>= 8"):
        generate("interleaved", 4, 8, active_microbatches=6, virtual_stages=2)
    with pytest.raises(SMPConfigError, match="cannot be lower"):
        generate("zbv", 4, 8, active_microbatches=4, virtual_stages=2)


def test_validate_with_chunks_checks_dependencies_across_ranks() -> None:
    # chunk 2 (rank 0) needs chunk 1 (rank 1): rank 1 runs 1B0 only after 3I0 reaches it
    good = parse_schedule(["0F0 2F0 2I0 2W0 0B0", "1F0 3F0 3B0 1B0"])
    assert validate(good, 2, 1, num_chunks=4) == 8
    dead = parse_schedule(["0F0 0B0 2F0 2B0", "1F0 3F0 3B0 1B0"])
    with pytest.raises(ScheduleError, match="deadlocks.*rank 0 waits at 0B0"):
        validate(dead, 2, 1, num_chunks=4)
    with pytest.raises(ScheduleError, match="names every chunk"):
        validate(good, 2, 1)


def test_draw_names_chunks_when_a_rank_has_several() -> None:
    assert draw(generate("zbv", 1, 1, virtual_stages=2)).splitlines()[1] == (
        "rank0  0F0  1F0  1I0  1W0  0I0  0W0")


@pytest.mark.parametrize("name", ["simple", "interleaved", "zero_bubble"])
@pytest.mark.parametrize("placement", [(0, 1, 0), (0, 1, 2, 3, 0), (0, 0, 0, 1)])
def test_uneven_placements_of_a_manual_partition_run(name: str, placement: tuple[int, ...]
                                                     ) -> None:
    # a manual partition whose modules come back to an earlier rank: ranks hold different
    # numbers of chunks; the lists are valid and hold each chunk's work on its rank
    p = 1 + max(placement)
    schedule = generate(name, p, 4, placement=placement)
    validate(schedule, p, 4, num_chunks=len(placement))
    assert placement_of(schedule) == placement
