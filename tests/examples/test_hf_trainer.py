"""The Hugging Face Trainer's SMP mode on smp-fx (``examples/hf_trainer.py``): at pp=2 on 2
processes it trains (gradient accumulation 1 and 2, clipping), evaluates (also during
training, loading the best checkpoint at the end), predicts, saves and resumes exactly as
the plain Trainer does in one process.

Both runs start at once (the plain one in its own process, so its ``transformers`` import
never sees the SMP variables) and each prints one JSON line of per-step losses. The SMP run
goes through everything of the Trainer's SMP branch: ``smp.init()`` at import,
``smp.state.cfg``, ``smp.DistributedModel(model, backward_passes_per_step=...)``,
``@smp.step()`` (``smp_forward_backward`` divides the loss in place on every rank),
``smp_forward_only`` + ``smp_gather`` + ``StepOutput.concat`` in ``evaluate()`` and
``predict()`` (each wrapping the base model again: the same ``DistributedModel``),
``state_dict()`` + ``save_pretrained`` + ``smp.save(optimizer.local_state_dict(...),
partial=True, v3=False)`` when saving, and ``smp.resume_from_checkpoint`` +
``register_post_step_hook`` + ``smp.load(..., partial=True)`` when resuming, and
``smp.resume_from_checkpoint(..., partial=False)`` for ``load_best_model_at_end``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "hf_trainer.py"
SMP_ENV = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 2}),
           "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True})}


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _results(proc: subprocess.Popen[str], out_dir: Path, ranks: int) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-6000:]
    files = [out_dir / f"result_{r}.json" for r in range(ranks)]
    assert all(f.exists() for f in files), out[-2000:] + err[-4000:]
    return [json.loads(f.read_text(encoding="utf-8")) for f in files]


@pytest.mark.multiproc
def test_trainer_smp_mode_matches_plain_trainer(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if k not in SMP_ENV}
    base.update(OMP_NUM_THREADS="1", SMP_FX_TIMEOUT_S="300", TOKENIZERS_PARALLELISM="false")
    smp_run = _start([sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2", str(SCRIPT),
                      str(tmp_path / "smp")], {**base, **SMP_ENV})
    plain_run = _start([sys.executable, str(SCRIPT), str(tmp_path / "plain")], base)
    try:
        (plain,) = _results(plain_run, tmp_path / "plain", 1)
        smp_ranks = _results(smp_run, tmp_path / "smp", 2)
    finally:
        for proc in (smp_run, plain_run):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    stage_norms = [torch.tensor(r.pop("grad_norm")) for r in smp_ranks]
    assert smp_ranks[0] == smp_ranks[1], "the two pipeline ranks report different losses"
    got = smp_ranks[0]
    # max_grad_norm clips by each stage's local norm (the Trainer's SMP branch without fp16):
    # each stage's norm is at most the global one (a tied weight's gradient is complete on
    # both stages), the stages' norms differ, and together they cover the global norm
    whole = torch.tensor(plain["grad_norm"])
    assert len(whole) == 4 and all(len(n) == 4 for n in stage_norms)
    assert all(bool((n <= whole * (1 + 1e-5)).all()) for n in stage_norms), (stage_norms, whole)
    assert not torch.allclose(stage_norms[0], stage_norms[1])
    assert bool((stage_norms[0] ** 2 + stage_norms[1] ** 2 >= whole ** 2 * (1 - 1e-5)).all())
    for run in ("gas1", "resumed", "gas2"):
        assert len(got[run]) == len(plain[run]) == 4, run
        torch.testing.assert_close(torch.tensor(got[run]), torch.tensor(plain[run]),
                                   rtol=1e-5, atol=1e-5, msg=lambda m, r=run: f"{r}: {m}")
    assert got["predict"][0] == plain["predict"][0] == [8, 16, 64]  # logits of every sample
    for checksum in (1, 2):  # per sample, in order: its logits' sum and sum of magnitudes
        mine, theirs = torch.tensor(got["predict"][checksum]), torch.tensor(
            plain["predict"][checksum])
        assert mine.shape == theirs.shape == (8,)
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-3)
    # the per-sample sums tell the samples apart, so an order change cannot pass unseen
    sums = torch.tensor(plain["predict"][1])
    assert bool(((sums[:, None] - sums[None, :]).abs() + torch.eye(8) * 1e9 > 1e-2).all()), sums
    for run in ("eval", "gas2_evals", "best"):
        torch.testing.assert_close(got[run], plain[run], rtol=1e-5, atol=1e-5)
    # load_best_model_at_end: the Trainer's SMP branch loads the best checkpoint in full
    assert len(got["gas2_evals"]) == 2 and got["gas2_evals"][0] != got["gas2_evals"][1]
    torch.testing.assert_close(got["best"], min(got["gas2_evals"]), rtol=1e-6, atol=1e-6)
    # resuming at step 2 continues as the uninterrupted run did (steps 3 and 4 computed anew)
    torch.testing.assert_close(torch.tensor(got["resumed"][2:]), torch.tensor(got["gas1"][2:]),
                               rtol=1e-6, atol=1e-6)
    assert got["gas1"] != got["gas2"]  # accumulation changes the run, in both modes alike
    checkpoint = tmp_path / "smp" / "gas1" / "checkpoint-2"
    assert {"model.safetensors", "optimizer.pt_0", "optimizer.pt_1",
            "optimizer.pt.smp_index.json"} <= set(os.listdir(checkpoint))
