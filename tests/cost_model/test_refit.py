"""The refit's numbers and the measurement file: exact rows give back the multipliers, rows
that cannot tell work from fixed cost give one (and say so), the bisection meets its
target, a measurement round-trips and groups a schedule's chunks by pipeline rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.errors import SMPConfigError
from cost_model.measurement import MeasuredConfig, Measurement, RankFigures
from cost_model.refit import Moved, Row, fit_scales, format_moved, solve_monotone


def _rows(a: float, b: float, shares: list[tuple[float, float, float]]) -> list[Row]:
    return [Row(f"row {i}", a * w + b * f + 2e-5 + o, w, f, 2e-5, o)
            for i, (w, f, o) in enumerate(shares)]


def test_exact_rows_give_back_both_multipliers() -> None:
    rows = _rows(2.5, 0.4, [(1e-3, 5e-4, 1e-4), (3e-3, 2e-4, 0.0), (1e-4, 1e-3, 5e-5)])
    a, b, c, why = fit_scales(rows)
    assert a == pytest.approx(2.5, rel=1e-9) and b == pytest.approx(0.4, rel=1e-9)
    assert c == 1.0 and why == ""


def test_rows_that_cannot_tell_work_from_fixed_cost_give_one_multiplier() -> None:
    shares = [(1e-3, 1e-3, 1e-3), (2e-3, 2e-3, 2e-3)]  # same shares, runtime too
    rows = [Row(f"row {i}", 3.0 * (w + f + rt), w, f, rt, 0.0)
            for i, (w, f, rt) in enumerate(shares)]
    a, b, c, why = fit_scales(rows)
    assert a == b == c == pytest.approx(3.0, rel=1e-9) and "common multiplier" in why
    held = fit_scales([Row("short", 1e-4, 1e-3, 1e-3, 0.0, 5e-4)] * 2)  # below its rest
    assert held[:3] == (1e-3, 1e-3, 1e-3) and "held at x0.001" in held[3]
    assert fit_scales([]) == (1.0, 1.0, 1.0, "no measured forward or backward: compute "
                                             "factors kept")


def test_bisection_meets_a_non_increasing_target() -> None:
    k = solve_monotone(lambda x: 0.5 + 2.0 / x, 1.3)
    assert 0.5 + 2.0 / k == pytest.approx(1.3, rel=1e-6)
    assert solve_monotone(lambda x: 1.0 / x, 1e9) == 1e-3  # beyond reach: the end


def test_table_names_each_factor_before_after_and_source() -> None:
    text = format_moved([Moved("compute_scale", 1.0, 2.0, "F, B"),
                         Moved("message_overhead_s", 1e-5, 2e-4, "sends")])
    assert text.splitlines()[0].split()[:4] == ["factor", "before", "after", "x"]
    assert "compute_scale" in text and "2.00" in text and "200.0 us" in text


def _measurement() -> Measurement:
    cfg = MeasuredConfig(world=2, tp=1, pp=2, dp=1, mbs=2, microbatches=4, vp=2,
                         schedule="zbv", recompute="none", sp=False, zero="none",
                         precision="fp32", device="cpu", hardware="cpu")
    # zbv at v 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    r0 = RankFigures(0, 0, 0, 0, 0.1, (("F", 0, 0.004, 4.0), ("F", 3, 0.008, 4.0),
                                       ("SEND_ACT", 0, 0.001, 4.0)), 0.02, 0.0, 1 << 20,
                     "peak_rss")
    r1 = RankFigures(1, 1, 0, 0, 0.12, (("F", 1, 0.002, 4.0), ("F", 2, 0.002, 4.0),
                                        ("SEND_ACT", 2, 0.003, 4.0)), 0.01, 0.0, 2 << 20,
                     "peak_rss")
    return Measurement(cfg, 10, 0.12, (r0, r1))


def test_measurement_round_trips_and_groups_chunks_by_rank(tmp_path: Path) -> None:
    m = _measurement()
    m.save(tmp_path / "m.json")
    back = Measurement.load(tmp_path / "m.json")
    assert back == m and Measurement.from_json(m.to_json()) == m
    assert m.by_pp_rank("F") == pytest.approx([0.003, 0.001])
    assert m.per_op(("SEND_ACT",)) == pytest.approx(0.0005)
    assert m.config.global_batch == 8 and m.peak_memory_bytes() == 2 << 20
    assert m.config.fix()["schedule"] == "zbv"


def test_a_bad_file_is_one_error(tmp_path: Path) -> None:
    bad = {**_measurement().to_json(), "schema_version": 99}
    with pytest.raises(SMPConfigError, match="schema_version"):
        Measurement.from_json(bad)
    (tmp_path / "x.json").write_text("[1]")
    with pytest.raises(SMPConfigError, match="JSON object"):
        Measurement.load(tmp_path / "x.json")
