"""``benchmarks/plan_gpu.py --tiny`` on the CPU: calibrate, plan, train, figures written.

The GPU run (docs/planning.md, "On a GPU") cannot run here; this checks the script end to
end at a tiny size so the one GPU run does not fail on plumbing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.processes import run_script_on_cpu


@pytest.mark.multiproc
def test_plan_gpu_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "plan_gpu.json"
    run = run_script_on_cpu("benchmarks/plan_gpu.py", "--tiny", "--out", str(out),
                            cwd=tmp_path, timeout=240)
    assert "step time:  predicted" in run.stdout
    figures = json.loads(out.read_text())
    plan = figures["plan"]
    assert (plan["tp"], plan["pp"], plan["dp"], plan["recompute"]) == (1, 1, 1, "full")
    assert plan["microbatches"] * plan["mbs"] == figures["model"]["global_batch"] == 4
    measured = figures["measured"]
    assert len(measured["step_times_s"]) == 3 and measured["step_time_s"] > 0
    assert measured["losses"][-1] < measured["losses"][0]  # it trained
    assert figures["step_ratio"] == pytest.approx(
        measured["step_time_s"] / plan["step_time_s"])
