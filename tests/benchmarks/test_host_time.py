"""``benchmarks/host_time.py --tiny`` on the CPU: every run trains, each row is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.processes import run_script_on_cpu


@pytest.mark.multiproc
def test_host_time_tiny_writes_a_row_per_run(tmp_path: Path) -> None:
    out = tmp_path / "host_time.json"
    run = run_script_on_cpu("benchmarks/host_time.py", "--tiny", "--compile", "--calls",
                            "--microbatches", "1", "2", "--out", str(out), cwd=tmp_path)
    figures = json.loads(out.read_text())
    rows = [(r["microbatches"], r["samples"], r["compile"]) for r in figures["rows"]]
    assert rows == [(1, 4, None), (2, 2, None), (2, 2, "aot_eager")]  # compiled: the most
    for r in figures["rows"]:
        assert r["step_s"] > 0 and r["aten_calls"] > 100
        assert r["per_microbatch_s"] == pytest.approx(r["step_s"] / r["microbatches"])
    assert figures["model"]["n_layer"] == 4 and "2 x mbs 2, aot_eager" in run.stdout
    # --calls: smp-fx's step and the plain loop's make the same calls but for smp-fx's own
    one, two = figures["python_calls"]
    assert (one["microbatches"], two["microbatches"]) == (1, 2)
    for r in (one, two):
        assert r["plain_calls"] < r["smp_fx_calls"] < 1.2 * r["plain_calls"]
    assert two["plain_calls"] > 1.5 * one["plain_calls"]  # a microbatch's calls, again
