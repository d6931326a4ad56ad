"""``smp-fx plan``: the table, --json / --fix / --emit-config round trips, bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost_model.cluster import ClusterSpec, get_cluster
from smp_fx.cli import main as cli_main
from smp_fx.cli import plan as plan_cli
from smp_fx.config import load_config, validate
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.result import PLAN_KEYS, PlanRecord
from smp_fx.planner.smp_config import refusal

ROOT = Path(__file__).resolve().parents[3]
GPT = ["--build-arg", "n_layer=4", "--build-arg", "n_embd=32", "--build-arg", "n_head=4",
       "--build-arg", "vocab_size=64", "--build-arg", "seq_len=16", "--inputs-arg",
       "seq_len=16", "--inputs-arg", "vocab_size=64"]


def _plan(*extra: str) -> list[str]:
    return [str(ROOT / "examples/models/gpt.py"), *GPT, "--device", "a100", "--gpus", "8",
            "--global-batch", "16", "--quiet", *extra]


def test_table_json_and_fix_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    assert cli_main.main(["plan", *_plan("--json", str(out), "--top", "3")]) == 0
    text = capsys.readouterr().out
    assert "tokens/s" in text and "best:" in text and "dgx-a100-80gb" in text
    doc = json.loads(out.read_text())
    assert set(doc) == {"model", "cluster", "best", "candidates"}
    assert set(PLAN_KEYS) <= set(doc["best"])
    assert doc["best"] == doc["candidates"][0] and len(doc["candidates"]) == 3
    assert doc["model"]["layers"] == 4 and doc["model"]["global_batch"] == 16
    assert ClusterSpec.from_json(doc["cluster"]) == get_cluster("dgx-a100-80gb")
    for cand in doc["candidates"]:
        assert PlanRecord.from_json(cand).to_json() == cand
    # --fix with every key of a plan prices exactly that plan again
    best = PlanRecord.from_json(doc["best"])
    again = tmp_path / "again.json"
    assert plan_cli.main(_plan("--fix", best.fix_text(), "--json", str(again))) == 0
    fixed = json.loads(again.read_text())["best"]
    assert fixed == doc["best"]


def test_emit_config_is_what_smp_init_takes(tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    cfg_path, json_path = tmp_path / "cfg.json", tmp_path / "plan.json"
    assert plan_cli.main(_plan("--fix", "pp=2,tp=2,recompute=selective", "--emit-config",
                               str(cfg_path), "--json", str(json_path))) == 0
    text = capsys.readouterr().out
    assert "smp-fx run -n 8 --config" in text and "set_partition" in text
    cfg = json.loads(cfg_path.read_text())
    best = json.loads(json_path.read_text())["best"]
    smp = load_config(cfg, env={})
    assert (smp.pipeline_parallel_degree, smp.tensor_parallel_degree, smp.microbatches) == (
        best["pp"], best["tp"], best["microbatches"])
    assert smp.pipeline == best["schedule"] and smp.prescaled_batch is True
    assert smp.optimize == ("memory" if best["sp"] else "speed")
    assert smp.virtual_pipeline_degree == best["vp"]
    assert best["recompute"] == "selective" and smp.recompute_granularity == "selective"
    validate(cfg, 8)  # smp.init's checks on that many processes


def test_a_refusal_is_smp_init_s_own_rule() -> None:
    """What the search leaves out under --emit-config is what ``smp.init`` refuses, in its
    words: here interleaving at v = 2 with one microbatch per step."""
    odd = Candidate(tp=1, pp=2, dp=4, mbs=4, vp=2, schedule="interleaved",
                    recompute="none", sp=False, zero="none")
    assert "multiple" in (refusal(odd, 16, "fp32") or "")
    assert refusal(dataclasses.replace(odd, vp=1), 16, "fp32") is None


@pytest.mark.parametrize("extra, message", [
    (["--fix", "tp=3"], "tp divides the GPU count"),
    (["--fix", "pp=2,tp=2,dp=4"], "tp x pp x cp x dp equals the GPU count"),
    (["--fix", "warp=9"], "--fix takes KEY=VALUE"),
    (["--gpu-memory-gib", "2.0001"], "no plan fits in GPU memory"),
    (["--gpu-memory-gib", "1"], "memory_reserved_bytes must be >= 0 and below"),
    (["--cluster", "dgx-z9000"], "a cluster is a built-in name or a JSON file"),
])
def test_bad_input_is_one_line_and_exit_2(extra, message, capsys) -> None:
    assert plan_cli.main(_plan(*extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("smp-fx plan: error:") and message in err and "\n" not in err


def test_bad_cluster_file_rejected(tmp_path: Path, capsys) -> None:
    doc = get_cluster("dgx-h100").to_json()
    doc["inter_node_bandwidth"] = -1
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    assert plan_cli.main(_plan("--cluster", str(path))) == 2
    assert "inter_node_bandwidth must be > 0" in capsys.readouterr().err


def test_scaling_curve_and_timeline(tmp_path: Path, capsys) -> None:
    png, curve = tmp_path / "t.png", tmp_path / "s.png"
    assert plan_cli.main(_plan("--fix", "schedule=interleaved,vp=1,pp=2", "--timeline",
                               str(png))) == 0
    assert png.stat().st_size > 0
    args = _plan("--plot", str(curve), "--tokens", "1e9")
    args[args.index("--gpus") + 1] = "4,8,16"
    assert plan_cli.main(args) == 0
    text = capsys.readouterr().out
    assert "GPU-hours (1e+09 tok)" in text and curve.stat().st_size > 0


def test_fp8_prices_on_an_fp8_gpu_and_refuses_what_it_cannot(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.json"
    args = [*_plan("--fix", "tp=1,pp=1,mbs=2", "--json", str(out))]
    h100 = [a if a != "a100" else "h100" for a in args]
    assert plan_cli.main([*h100, "--fp8"]) == 0
    assert "bf16 with FP8 linears" in capsys.readouterr().out
    assert json.loads(out.read_text())["model"]["fp8_linears"] is True
    assert plan_cli.main(h100) == 0
    assert json.loads(out.read_text())["model"]["fp8_linears"] is False
    capsys.readouterr()
    assert plan_cli.main([*args, "--fp8"]) == 2  # an A100 has no FP8 tensor cores
    assert "FP8 GEMMs need FP8 tensor cores" in capsys.readouterr().err
    assert plan_cli.main([*h100, "--fp8-params"]) == 2
    assert "FP8 parameters are the weights of FP8 linears" in capsys.readouterr().err
    assert plan_cli.main([*h100, "--fp8", "--fp8-params"]) == 0
    capsys.readouterr()
    assert plan_cli.main([*h100, "--fp8", "--emit-config", str(tmp_path / "c.json")]) == 2
    assert "does not train in FP8" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()
