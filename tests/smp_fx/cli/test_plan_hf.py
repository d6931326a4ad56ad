"""``smp-fx plan --hf-config PATH --seq-len N`` and ``--seq-len`` for model files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smp_fx.cli import plan as plan_cli

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "tests" / "data" / "hf_tiny_llama"
MIXTRAL = ROOT / "tests" / "data" / "hf_tiny_mixtral" / "config.json"
RUN = ["--device", "a100", "--gpus", "2", "--global-batch", "4", "--quiet", "--top", "1"]


def test_hf_config_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A Mixtral: its experts share sizes export computes once (``layers.tidy``)."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from smp_fx.planner.hf_config import load_config

    out = tmp_path / "plan.json"
    assert plan_cli.main(["--hf-config", str(MIXTRAL), "--seq-len", "32", *RUN,
                          "--json", str(out)]) == 0
    assert "plan for hf_tiny_mixtral on 2 x a100" in capsys.readouterr().out
    model = json.loads(out.read_text())["model"]
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(load_config(MIXTRAL))
    assert (model["layers"], model["layer_path"], model["tokens_per_sample"]) == \
        (5, "model.model.layers.N", 32)
    assert model["parameters"] == sum(p.numel() for p in whole.parameters())


def test_seq_len_reaches_a_model_file(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = [str(ROOT / "examples/models/gpt.py"), "--build-arg", "n_layer=4", "--build-arg",
            "n_embd=32", "--build-arg", "n_head=4", "--seq-len", "48", *RUN, "--json", str(out)]
    assert plan_cli.main(args) == 0
    assert json.loads(out.read_text())["model"]["tokens_per_sample"] == 48


@pytest.mark.parametrize("args, message", [
    (["--hf-config", "/nonexistent/config.json", "--seq-len", "8"], "names a config.json"),
    (["--hf-config", str(TINY)], "--hf-config needs --seq-len"),
    ([str(ROOT / "examples/models/gpt.py"), "--hf-config", str(TINY), "--seq-len", "8"],
     "either a model file or --hf-config"),
    ([], "needs a model file or --hf-config"),
    ([str(ROOT / "examples/models/mlp.py"), "--seq-len", "8"],
     "--seq-len needs example_inputs() to take seq_len"),
    (["--hf-config", str(TINY), "--seq-len", "0"], "--seq-len is a positive token count"),
])
def test_bad_input_is_one_line(args: list[str], message: str,
                               capsys: pytest.CaptureFixture) -> None:
    assert plan_cli.main([*args, *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("smp-fx plan: error:") and message in err and "\n" not in err
