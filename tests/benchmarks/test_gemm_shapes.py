"""benchmarks/gemm_shapes.py: the GEMMs a run's plan prices, and priced against timed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gemm_shapes as gs  # noqa: E402
import plan_validation as pv  # noqa: E402

from tests.helpers.processes import run_script_on_cpu  # noqa: E402


def _run(run_id: str) -> Any:
    return next(r for r in pv.read_runs() if r.id == run_id)


@pytest.fixture(scope="module")
def collected() -> dict[str, Any]:
    """Megatron-Core's 1.7B (tp 1) and 7.1B (tp 2, sp) runs, as ``collect`` writes them."""
    return {"runs": [gs.collect_run(_run("megatron-core-h100-1.7b")),
                     gs.collect_run(_run("megatron-core-h100-7.1b"))]}


def test_a_layers_gemms_are_the_shapes_one_tensor_parallel_rank_runs(
        collected: dict[str, Any]) -> None:
    one, two = collected["runs"]
    tokens, h, vocab = 4096, 2048, 131072  # mbs 1 x seq 4096; hidden; the row's vocabulary
    shapes = [(g["part"], g["m"], g["k"], g["n"]) for g in one["gemms"]]
    assert shapes == [("layer", tokens, h, 3 * h), ("layer", tokens, h, h),
                      ("layer", tokens, h, 4 * h), ("layer", tokens, 4 * h, h),
                      ("tail", tokens, h, vocab)]
    assert one["layers"] == 24 and one["plan"].startswith("tp1 pp1")
    h = 4096  # the 7.1B at tp 2: column linears halve their outputs, row linears their input
    assert [(g["m"], g["k"], g["n"]) for g in two["gemms"] if g["part"] == "layer"] == [
        (tokens, h, 3 * h // 2), (tokens, h // 2, h), (tokens, h, 2 * h), (tokens, 2 * h, h)]
    for g in one["gemms"] + two["gemms"]:  # priced: forward, and backward at twice its FLOPs
        assert g["priced_forward_s"] > 0 and g["priced_backward_s"] == pytest.approx(
            2 * g["priced_forward_s"], rel=0.2)


def test_compare_sums_a_layers_gemms_priced_against_timed(collected: dict[str, Any]) -> None:
    def timed(scale: float) -> dict[str, Any]:
        rows = []
        for run in collected["runs"]:
            for g in run["gemms"]:
                f, b = g["priced_forward_s"] * scale, g["priced_backward_s"] * scale
                rows.append({"m": g["m"], "k": g["k"], "n": g["n"], "batch": g["batch"],
                             "forward_s": f, "input_grad_s": b / 2, "weight_grad_s": b / 2})
        return {"device": "test", "dtype": "bfloat16", "torch": "-", "cuda": "-",
                "shapes": rows}

    for scale in (1.0, 1.25):
        lines = gs.compare(collected, timed(scale))
        assert f"median {scale:.3f}, range {scale:.3f}-{scale:.3f} over 2 runs" in lines[-1]
    missing = timed(1.0)
    missing["shapes"] = missing["shapes"][1:]  # the 1.7B's QKV not timed: said, not summed
    assert any("megatron-core-h100-1.7b" in x and "not timed" in x
               for x in gs.compare(collected, missing))


def test_the_grid_adds_shapes_no_run_chose(collected: dict[str, Any]) -> None:
    own = gs.shapes_of(collected, grid=False)
    assert len(own) == len(set(own)) == 10  # each run's 4 layer GEMMs and head, no two alike
    grid = gs.shapes_of(collected, grid=True)
    full = {(m, k, n, 1) for m in gs.GRID_M for k in gs.GRID_KN for n in gs.GRID_KN}
    assert grid[:len(own)] == own and len(grid) == len(set(grid))
    assert set(grid) == set(own) | full and set(own) & full  # 4096 x 2048 x 2048 is both


@pytest.mark.multiproc
def test_time_tiny_runs_on_the_cpu(tmp_path: Path, collected: dict[str, Any]) -> None:
    src = tmp_path / "s.json"
    src.write_text(json.dumps(collected))
    out = tmp_path / "t.json"
    run_script_on_cpu("benchmarks/gemm_shapes.py", "time", str(src), "--tiny", "--out",
                      str(out), cwd=tmp_path)
    timed = json.loads(out.read_text())
    assert timed["device"] == "cpu" and len(timed["shapes"]) == 4
    assert [(r["fp8"], r["casts_input"]) for r in timed["shapes"]] == [
        (False, True), (False, True), (True, True), (True, False)]  # torch._scaled_mm
    for row in timed["shapes"]:
        assert all(row[f"{f}_s"] > 0 for f in gs.FORMS)


def test_an_fp8_rows_layer_gemms_are_timed_in_fp8_and_its_head_in_bf16() -> None:
    fp8, bf16 = (gs.collect_run(_run(r)) for r in ("nemo-24.09-h100-llama3.1-8b-fp8-8",
                                                   "nemo-24.09-h100-llama3.1-8b-8"))
    shape = [(g["part"], g["m"], g["k"], g["n"]) for g in fp8["gemms"]]
    assert shape == [(g["part"], g["m"], g["k"], g["n"]) for g in bf16["gemms"]]
    assert {g["part"] for g in fp8["gemms"] if g["fp8"]} == {"layer"}
    assert [g for g in fp8["gemms"] if g["part"] == "tail"] and not any(
        g["fp8"] for g in fp8["gemms"] if g["part"] != "layer")
    assert not any(g["fp8"] for g in bf16["gemms"])
    # q, k and v read one input, gate and up another: each cast once, by the first
    layer = [g for g in fp8["gemms"] if g["part"] == "layer"]
    assert [g["casts_input"] for g in layer] == [True, False, False, True, True, False, True]
    for a, b in zip(fp8["gemms"], bf16["gemms"], strict=True):
        if a["fp8"] and a["n"] >= a["k"]:  # large GEMMs: about half the time, plus casts
            assert 0.45 < a["priced_forward_s"] / b["priced_forward_s"] < 0.8, a
    both = {"runs": [fp8]}
    assert {(g["m"], g["k"], g["n"], g["casts_input"]) for g in layer} == set(
        gs.fp8_shapes_of(both))
    assert gs.shapes_of(both, grid=False) == [
        (g["m"], g["k"], g["n"], g["batch"]) for g in fp8["gemms"] if g["part"] != "layer"]
