"""Launches beyond one host, on localhost: two ``smp-fx run --nnodes 2`` launchers meeting
through a c10d rendezvous run an SMP script at pp = 2 x dp = 2 (one process per pipeline
stage on each "node") and train exactly as one process with plain PyTorch does; the SLURM
and Open MPI environments are covered in ``tests/smp_fx/world/test_slurm.py`` and
``test_comm.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import free_port

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "examples" / "launch" / "train_tiny.py"


@pytest.mark.multiproc
def test_two_launchers_pp2_dp2_equal_one_process(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SMP_FX_TIMEOUT_S": "120",
           "SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 2,
                                              "ddp": True})}
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2", "--nnodes", "2",
         "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id", "two-nodes",
         "--rdzv-endpoint", f"127.0.0.1:{port}", str(SCRIPT), str(tmp_path / "smp")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    try:
        for proc in launchers:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-4000:]
    finally:
        for proc in launchers:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    from examples.launch.train_tiny import reference

    ref = reference()
    ranks = [json.loads((tmp_path / "smp" / f"result_{r}.json").read_text(encoding="utf-8"))
             for r in range(4)]
    # 4 ranks, 2 per launcher; each (pp, dp) place once
    assert sorted(r["ranks"][:4] for r in ranks) == [[r, 4, r % 2, 2] for r in range(4)]
    assert sorted(tuple(r["ranks"][4:]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["launcher"] for r in ranks} == {"torchrun"}
    for r in ranks:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        if r["params"]:  # data-parallel rank 0 of each stage gathers the whole model
            assert r["params"].keys() == ref["params"].keys()
            torch.testing.assert_close(r["params"], ref["params"], rtol=1e-5, atol=1e-5)
    assert sum(bool(r["params"]) for r in ranks) == 2
