"""The Hugging Face Trainer's SMP mode on smp-fx (``examples/hf_trainer.py``, a script that
knows nothing of smp-fx: no optimizer passed, no device set): at pp=2 on 2 processes it
trains (gradient accumulation 1 and 2, clipping), evaluates (also during training, loading
the best checkpoint at the end), predicts, saves and resumes exactly as the plain Trainer
does in one process, with the transformers of the environment (``make test`` runs this file
with the project's pin and again in a virtual environment with a 4.x,
``make test-transformers4``).

Both runs start at once (the plain one in its own process, forked from the forkserver of
``tests.helpers.dist``, whose ``transformers`` import never saw the SMP variables) and each
writes one JSON file of results per rank. The SMP
run goes through everything of the Trainer's SMP branch: ``smp.init()`` at import,
``smp.state.cfg``, ``smp.DistributedModel(model, backward_passes_per_step=...)``,
``@smp.step()`` (``smp_forward_backward`` divides the loss in place on every rank),
``smp_forward_only`` in ``evaluate()`` and ``predict()`` (each wrapping the base model
again: the same ``DistributedModel``), ``state_dict()`` + ``save_pretrained`` +
``smp.save(optimizer.local_state_dict(...), partial=True, v3=False)`` when saving, and
``smp.resume_from_checkpoint`` + ``register_post_step_hook`` + ``smp.load(...,
partial=True)`` when resuming, and ``smp.resume_from_checkpoint(..., partial=False)`` for
``load_best_model_at_end``.
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

from smp_fx._compat import SHIM_DIR
from tests.helpers.dist import run_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "hf_trainer.py"
SMP_ENV = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 2}),
           "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True})}
# transformers 4.x reads its own RNG-state files with torch.load's pre-2.6 default
PLAIN_ENV = {"OMP_NUM_THREADS": "1", "SMP_FX_TIMEOUT_S": "300",
             "TOKENIZERS_PARALLELISM": "false", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _results(proc: subprocess.Popen[str], out_dir: Path, ranks: int) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-6000:]
    return _read(out_dir, ranks, out[-2000:] + err[-4000:])


def _read(out_dir: Path, ranks: int, output: str = "") -> list[dict[str, Any]]:
    files = [out_dir / f"result_{r}.json" for r in range(ranks)]
    assert all(f.exists() for f in files), output
    return [json.loads(f.read_text(encoding="utf-8")) for f in files]


@pytest.mark.multiproc
def test_trainer_smp_mode_matches_plain_trainer(tmp_path: Path) -> None:
    # transformers 4.46's plain branch sums accumulated gradients where its SMP branch
    # averages them (examples/hf_trainer.py, --average-accumulation): compared with the
    # plain Trainer that averages, as the other versions' does
    plain_args = ["--average-accumulation"] if _plain_sums_accumulation() else []
    plain, smp_ranks = _run_pair(tmp_path, 2, SMP_ENV, [], plain_args)
    stage_norms = [torch.tensor(r.pop("grad_norm")) for r in smp_ranks]
    accumulated_norms = [torch.tensor(r.pop("gas2_grad_norm")) for r in smp_ranks]
    assert smp_ranks[0] == smp_ranks[1], "the two pipeline ranks report different losses"
    got = smp_ranks[0]
    _check_stage_norms(stage_norms, plain["grad_norm"])
    _check_stage_norms(accumulated_norms, plain["gas2_grad_norm"])
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
    # the plain Trainer's weight file (safetensors from 4.3x on), the optimizer per stage
    weights = {"model.safetensors", "pytorch_model.bin"} & set(plain["checkpoint_files"])
    assert weights and weights <= set(got["checkpoint_files"])
    assert {"optimizer.pt_0", "optimizer.pt_1", "optimizer.pt.smp_index.json"} <= set(
        got["checkpoint_files"])


def _plain_sums_accumulation() -> bool:
    """``plain_sums_accumulation`` for the installed transformers."""
    import transformers

    from examples.hf_trainer import plain_sums_accumulation

    return plain_sums_accumulation(transformers.__version__)


def _check_stage_norms(stage_norms: list[torch.Tensor], plain_norms: list[float]) -> None:
    """``max_grad_norm`` (the Trainer's default, 1.0) clips by the whole model's norm on
    every stage, the plain Trainer's (transformers 4.2x logs no norm)."""
    if not plain_norms:
        assert all(len(n) == 0 for n in stage_norms)
        return
    whole = torch.tensor(plain_norms)
    assert len(whole) == 4 and bool((whole > 1.0).any()), whole  # it scales some steps
    for norms in stage_norms:
        torch.testing.assert_close(norms, whole, rtol=1e-5, atol=1e-6)


def _run_pair(tmp_path: Path, ranks: int, smp_env: dict[str, str], smp_args: list[str],
              plain_args: list[str], torchrun: bool = False
              ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The script in SMP mode on ``ranks`` processes (``smp-fx run``, or plain torchrun
    with the shim directory on ``PYTHONPATH``) beside the plain Trainer in one."""
    base = {k: v for k, v in os.environ.items() if k not in SMP_ENV}
    base.update(PLAIN_ENV)
    launch = [sys.executable, "-m", "smp_fx.cli.main", "run", "-n", str(ranks)]
    if torchrun:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", str(ranks)]
        smp_env = {**smp_env, "PYTHONPATH": os.pathsep.join(
            p for p in (str(SHIM_DIR), os.environ.get("PYTHONPATH")) if p)}
    smp_run = _start([*launch, str(SCRIPT), str(tmp_path / "smp"), *smp_args],
                     {**base, **smp_env})
    try:
        run_script(str(SCRIPT), str(tmp_path / "plain"), *plain_args, env=PLAIN_ENV,
                   unset=tuple(SMP_ENV), timeout=400)
        (plain,) = _read(tmp_path / "plain", 1)
        return plain, _results(smp_run, tmp_path / "smp", ranks)
    finally:
        if smp_run.poll() is None:
            smp_run.kill()
            smp_run.communicate()


@pytest.mark.multiproc
def test_trainer_pp2_dp2_trains_each_replica_on_its_shard(tmp_path: Path) -> None:
    """pp=2 x dp=2 on 4 processes launched by plain torchrun (the shim directory on
    ``PYTHONPATH``), per-device batch 4, against the plain Trainer at batch 8
    (the same global batches): every pipeline's ranks read the same samples, the two
    data-parallel replicas read disjoint halves of each global batch (SMP's rule:
    ``smp.dp_rank()`` / ``smp.dp_size()``), and the parameters saved by ``save_model`` after
    4 SGD steps, the evaluation loss and the predictions equal the plain Trainer's. GPT-2's
    ``use_cache`` stays at its default: with transformers 4.x every layer's key/value cache
    is a model output no loss depends on."""
    from safetensors.torch import load_file

    env = {**SMP_ENV, "SM_HP_MP_PARAMETERS": json.dumps(
        {"partitions": 2, "microbatches": 2, "ddp": True})}
    args = ["--train-only", "--optim", "sgd", "--default-cache"]
    plain, ranks = _run_pair(tmp_path, 4, env, [*args, "--batch", "4"], [*args, "--batch", "8"],
                             torchrun=True)
    plain, ranks = plain["sgd"], [r["sgd"] for r in ranks]
    replicas: dict[str, list[list[int]]] = {}
    for r in ranks:
        steps = r["samples"][:4]
        replicas.setdefault(json.dumps(steps), steps)
    assert len(replicas) == 2, "each pipeline reads one shard, the two pipelines differ"
    first, second = replicas.values()
    for k in range(4):
        assert not set(first[k]) & set(second[k]), f"step {k}: the replicas' shards overlap"
        assert sorted(first[k] + second[k]) == sorted(plain["samples"][k]), f"step {k}"
    for r in ranks:  # evaluation reads every sample on every rank: the plain Trainer's
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(plain["losses"]),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["eval"], plain["eval"], rtol=1e-5, atol=1e-5)
        assert r["predict"][0] == plain["predict"][0] == [8, 16, 64]
        torch.testing.assert_close(r["predict"][1:], plain["predict"][1:], rtol=1e-4,
                                   atol=1e-3)
    got = load_file(str(tmp_path / "smp" / "sgd" / "final" / "model.safetensors"))
    want = load_file(str(tmp_path / "plain" / "sgd" / "final" / "model.safetensors"))
    assert list(got) == list(want)  # the model's own names, the tied head saved once as HF does
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _same_training(got: dict[str, Any], plain: dict[str, Any], weights: tuple[Path, Path],
                   what: str, weights_tol: float = 1e-5) -> None:
    """The losses and the evaluation loss agree (1e-5), and so do the weights ``save_model``
    wrote (``weights_tol``: Adam turns the gradients' 1e-7 summation-order differences into
    steps of the learning rate where a gradient is that small)."""
    from safetensors.torch import load_file

    for key in ("losses", "eval"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(plain[key]),
                                   rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{what} {k}: {m}")
    mine, theirs = (load_file(str(w / "final" / "model.safetensors")) for w in weights)
    assert list(mine) == list(theirs)
    torch.testing.assert_close(mine, theirs, rtol=weights_tol, atol=weights_tol,
                               msg=lambda m: f"{what} weights: {m}")


@pytest.mark.multiproc
def test_trainer_tp2_equals_plain_trainer_with_adamw_and_sgd(tmp_path: Path) -> None:
    """tp=2 as AWS's GPT-2 Trainer script runs it (``smp.set_tensor_parallelism(model)``,
    nothing else changed: ``ddp``, the Trainer's default ``max_grad_norm`` 1.0), per-device
    batch 4, AdamW then SGD in one run, against the plain Trainer at batch 8 (what DDP on 2
    ranks computes): the Trainer clears gradients with ``model.zero_grad()`` only, so that
    must reach the tensor-parallel shards, and it clips by the whole model's norm. Weight
    decay 0.1, its groups named on the wrapped model (``--groups-on-wrapped``: the
    ``DistributedModel`` here, as transformers 4.2x and AWS's Bloom ``smp_trainer.py`` name
    them): ``get_parameter_names``' walk must give ``named_parameters()``' names."""
    env = {**SMP_ENV, "SM_HP_MP_PARAMETERS": json.dumps(
        {"partitions": 1, "tensor_parallel_degree": 2, "ddp": True})}
    args = ["--train-only", "--optim", "adamw_torch,sgd", "--set-tensor-parallelism",
            "--weight-decay", "0.1", "--groups-on-wrapped"]
    plain, ranks = _run_pair(tmp_path, 2, env, [*args, "--batch", "4"], [*args, "--batch", "8"])
    for optim, tol in (("adamw_torch", 1e-4), ("sgd", 1e-5)):
        for rank, got in enumerate(ranks):
            _same_training(got[optim], plain[optim], (tmp_path / "smp" / optim,
                                                      tmp_path / "plain" / optim),
                           f"{optim} rank {rank}", tol)
