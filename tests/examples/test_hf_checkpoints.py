"""Round trip to Hugging Face from pp = 2 x tp = 2 (``examples/hf_trainer_tp.py``): a GPT-2
marked for tensor parallelism trains with the Trainer in SMP mode on 4 processes, and what
``trainer.save_model()``, ``smp.save_checkpoint(partial=False)`` and ``smp-fx checkpoint
export`` (of ``smp.save_checkpoint(partial=True)``) write all load with
``AutoModelForCausalLM.from_pretrained`` in this plain process, with the model's own names,
the tied head once, and logits equal to the smp-fx model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smp_fx.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "hf_trainer_tp.py"


@pytest.mark.multiproc
def test_pp2_tp2_trainer_checkpoints_load_with_from_pretrained(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "SMP_FX_TIMEOUT_S": "300",
           "TOKENIZERS_PARALLELISM": "false",
           "SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "tensor_parallel_degree": 2,
                                              "microbatches": 2, "ddp": True}),
           "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True})}
    run = subprocess.run([sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "4",
                          str(SCRIPT), str(tmp_path)], cwd=REPO, env=env, text=True,
                         capture_output=True, timeout=500)
    assert run.returncode == 0, run.stderr[-6000:]
    export = ["checkpoint", "export", str(tmp_path / "partial" / "step4_partial"), "-o",
              str(tmp_path / "exported")]  # in this process: the command reads no variable
    capsys.readouterr()
    code = cli.main(export)
    assert code != 0 and "--config" in capsys.readouterr().err  # none beside the checkpoint
    code = cli.main([*export, "--config", str(tmp_path / "final" / "config.json")])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "saved at pp=2 tp=2" in out
    found = json.loads((tmp_path / "logits.json").read_text(encoding="utf-8"))
    assert found["tp_sharded"] > 0  # the attention, MLP and vocabulary were split
    got, ids = torch.tensor(found["logits"]), torch.tensor(found["ids"])
    names = None
    for folder in ("final", "full", "exported"):
        weights = load_file(str(tmp_path / folder / "model.safetensors"))
        assert "lm_head.weight" not in weights and "transformer.wte.weight" in weights, folder
        assert names is None or sorted(weights) == names, folder
        names = sorted(weights)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        with torch.no_grad():
            want = model(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, f=folder: f"{f}: {m}")
    assert (tmp_path / "full" / "model.pt").is_file()  # SMP's own full file, as before
