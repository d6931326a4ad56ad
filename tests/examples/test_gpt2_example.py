"""AWS's SMP GPT-2 example, reproduced by ``examples/train_gpt2_smp.py`` (same SMP calls,
arguments and data feeding), trains on smp-fx as one process does.

A tiny GPT-2 (4 layers, width 64, vocabulary 256, context 64), synthetic gzipped JSON data
in the example's format, dropout off, fp32, on CPU. Each distributed run is compared with
the script in one process, step by step (rtol 1e-5 on the loss of the whole batch):

* pp=2 through SMP's ``DistributedTransformerLMHead`` (``--use_distributed_transformer 1``,
  the script's default), the data read on pipeline rank 0 only and empty tensors on rank 1;
* the same with the notebook's ``--manual_partition 1``: only the layers are pinned, so the
  final norm and the head fall to partition 0 after partition 1's layers (chunks on ranks
  0, 1, 0);
* tp=2 with ``prescaled_batch`` false (each tp rank reads its own half of the batch);
* pp=2 x tp=2, saving a partial checkpoint at step 3 (its ``user_content`` holds the
  ``GPT2Config``, the argument dict and the scheduler's state), then resumed from it in a
  new job: steps 4 and 5 equal the uninterrupted run's.

The runs start one after another (the reference beside the first, forked from the
forkserver of ``tests.helpers.dist``, which has imported torch and transformers); on a
loaded 2-core machine the whole test takes three to five minutes (most of it starting
processes). The
Hugging Face model itself at pp=2 (``--use_distributed_transformer 0``) is run by AWS's
script in docs/clients.md.
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

from tests.helpers.dist import run_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "examples" / "train_gpt2_smp.py")


ENV = {"OMP_NUM_THREADS": "1", "SMP_FX_TIMEOUT_S": "300", "SMP_FX_DEVICE_SPEC": "a100",
       "TOKENIZERS_PARALLELISM": "false"}


def _start(nproc: int, args: list[str], out: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "SM_HP_MP_PARAMETERS"}
    env.update(ENV)
    launch = [sys.executable, "-m", "smp_fx.cli.main", "run", "-n", str(nproc), SCRIPT]
    return subprocess.Popen([*launch, *args, "--out", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0 and out.exists(), (stdout[-2000:], stderr[-6000:])
    result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return result


def _close(got: dict[str, Any], want: dict[str, Any], steps: list[int], what: str) -> None:
    assert got["steps"] == steps, what
    pick = [want["losses"][want["steps"].index(s)] for s in steps]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(pick), rtol=1e-5,
                               atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_example_trains_like_one_process_and_resumes_exactly(tmp_path: Path) -> None:
    from examples.train_gpt2_smp import make_data  # what --make_data runs, one process less

    data = tmp_path / "data"
    make_data(str(data))
    common = ["--training-dir", str(data), "--max_steps", "5"]
    runs = {
        "pp2 distributed transformer": (2, ["--pipeline_parallel_degree", "2"]),
        "pp2, the notebook's manual partition": (2, ["--pipeline_parallel_degree", "2",
                                                     "--manual_partition", "1"]),
        "tp2, prescaled_batch false": (2, ["--tensor_parallel_degree", "2",
                                           "--prescaled_batch", "0",
                                           "--train_batch_size", "2"]),
        "pp2 x tp2, saving at step 3": (4, ["--pipeline_parallel_degree", "2",
                                           "--tensor_parallel_degree", "2",
                                           "--checkpoint_freq", "3", "--checkpoint-dir",
                                           str(tmp_path / "ck")]),
    }
    results: dict[str, dict[str, Any]] = {}
    for i, (name, (nproc, extra)) in enumerate(runs.items()):
        out = tmp_path / f"run{i}.json"
        proc = _start(nproc, [*common, *extra], out)
        try:
            if i == 0:  # the reference, one process forked beside the first run
                run_script(SCRIPT, *common, "--out", str(tmp_path / "ref.json"), env=ENV,
                           unset=("SM_HP_MP_PARAMETERS",), timeout=600)
            results[name] = _result(proc, out)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    resumed = _start(4, [*common, *runs["pp2 x tp2, saving at step 3"][1],
                         "--load_partial", "1"], tmp_path / "resumed.json")
    results["resumed from step 3"] = _result(resumed, tmp_path / "resumed.json")
    reference = json.loads((tmp_path / "ref.json").read_text(encoding="utf-8"))
    steps = [1, 2, 3, 4, 5]
    assert reference["steps"] == steps
    for name in runs:
        _close(results[name], reference, steps, name)
    saved = sorted(os.listdir(tmp_path / "ck"))
    assert saved == ["newest", "total_steps3_partial"]
    _close(results["resumed from step 3"], results["pp2 x tp2, saving at step 3"], [4, 5],
           "resumed from step 3")
