"""``benchmarks/gpu_check.py --tiny`` on the CPU: every part runs and its table is printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.processes import run_script_on_cpu


@pytest.mark.multiproc
def test_gpu_check_tiny_runs_every_part_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    run = run_script_on_cpu("benchmarks/gpu_check.py", "--tiny", "--out", str(out),
                            "--profile", "--traces", str(tmp_path / "traces"), cwd=tmp_path)
    figures = json.loads(out.read_text())
    assert figures["cuda_tests"]["returncode"] == 0 and figures["cuda_tests"]["skipped"] > 0
    checks = [r["check"] for r in figures["rows"]]
    assert checks == ["GPT pp 1, eager", "GPT pp 1, compile: aot_eager",
                      "GPT pp 2 in one process, 4 microbatches", "GPT pp 1, 4 microbatches"]
    eager, compiled, pp2, pp1_m4 = figures["rows"]
    assert eager["predicted_step_s"] == compiled["predicted_step_s"] > 0
    assert pp2["predicted_step_s"] is None is pp1_m4["predicted_step_s"]
    # --profile: one more step of each under the profiler, its trace written
    assert len(list((tmp_path / "traces").glob("trace_*.json.gz"))) == 4
    for r in figures["rows"]:
        prof = r["profile"]
        assert prof["wall_s"] > 0 and prof["aten_calls"] > 100 and "aten::" in prof["top"]
        assert prof["gpu_kernels_s"] == 0.0  # the CPU runs no kernels
    assert "| GPT pp 1, 4 microbatches | " in figures["table"].split("GPU in kernels")[1]
    for r in figures["rows"]:
        assert r["measured_step_s"] > 0 and r["losses"][-1] < r["losses"][0]  # it trained
        assert r["peak_memory_bytes"] is None  # CPU: not measured
    # one model, one batch, one seed: the three runs agree (bf16 autocast, hence loose)
    for r in (compiled, pp2, pp1_m4):
        assert r["losses"] == pytest.approx(eager["losses"], rel=1e-2)
    assert figures["table"] in run.stdout and "| CUDA tests" in figures["table"]
    # the transfer streams need two devices: the CPU's row says so instead of a figure
    (note,) = figures["notes"].values()
    assert "need two devices, GPUs here: 0" in note and note in figures["table"]
