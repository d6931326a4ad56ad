"""benchmarks/attention_rates.py: its FLOP count, the rates it compares with, a CPU run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import attention_rates as ar  # noqa: E402

from cost_model.flops import op_flops  # noqa: E402
from tests.helpers.processes import run_script_on_cpu  # noqa: E402


def test_the_flop_count_is_the_cost_models() -> None:
    q = (2, 16, 1024, 128)
    fwd, bwd = op_flops("sdpa", [q, q, q], q, {})
    assert ar.full_square_flops(2, 16, 1024, 128) == fwd and bwd == 2 * fwd


def test_priced_rates_are_the_hopper_tables_at_their_lengths() -> None:
    assert ar.priced(4096)["cudnn"] == (1036e12, 798.4e12)
    assert ar.priced(2048)["flash"] == (596e12, 465.6e12)
    mid = ar.priced(3000)["cudnn"]
    assert 968e12 < mid[0] < 1036e12


@pytest.mark.multiproc
def test_tiny_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    run_script_on_cpu("benchmarks/attention_rates.py", "--tiny", "--out", str(out),
                      cwd=tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["length"]) for r in rows] == [("math", 64), ("math", 128)]
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in rows)
