"""The ready launch scripts in ``examples/launch/`` start ``train_tiny.py`` at pp = 2 on 2
processes, under stand-ins for ``srun`` and ``mpirun`` that set each task's variables by
hand exactly as those launchers document them (two "nodes" of one task each on localhost,
so the rendezvous host comes from the node list or ``-H``), and train as one process with
plain PyTorch does. (pp = 2 x dp = 2 on 4 ranks under srun's and mpirun's variables:
``tests/smp_fx/world/test_comm.py``; two launchers at pp = 2 x dp = 2:
``tests/smp_fx/cli/test_run_nodes.py``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import free_port

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "examples" / "launch"

# A launcher stand-in: starts the command once per task with the variables of its kind.
FAKE = '''#!{python}
import os, subprocess, sys
kind, args = os.path.basename(sys.argv[0]), sys.argv[1:]
n, per_node, cmd = 2, 1, []
while args:
    a = args.pop(0)
    if a in ("-np", "-n"):
        n = int(args.pop(0))
    elif a in ("-H", "--bind-to", "-x"):
        args.pop(0)
    elif a.startswith("-"):
        continue
    else:
        cmd = [a, *args]
        break
procs = []
for rank in range(n):
    node, local = divmod(rank, per_node)
    if kind == "srun":
        env = dict(SLURM_PROCID=rank, SLURM_NTASKS=n, SLURM_LOCALID=local, SLURM_NODEID=node,
                   SLURM_STEP_TASKS_PER_NODE=f"{{per_node}}(x{{n // per_node}})",
                   SLURM_STEP_NODELIST="localhost,localhost")
    else:
        env = dict(OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_SIZE=n,
                   OMPI_COMM_WORLD_LOCAL_RANK=local, OMPI_COMM_WORLD_LOCAL_SIZE=per_node)
    env = {{**os.environ, **{{k: str(v) for k, v in env.items()}}}}
    procs.append(subprocess.Popen(cmd, env=env))
sys.exit(max(p.wait(timeout=200) for p in procs))
'''


def _run_script(tmp_path: Path, script: str, args: list[str], env: dict[str, str]) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("srun", "mpirun"):
        (bin_dir / name).write_text(FAKE.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                            os.environ.get("PATH", "")])
    res = subprocess.run(["bash", str(LAUNCH / script), *args], cwd=REPO, text=True,
                         capture_output=True, timeout=300,
                         env={**os.environ, "PATH": path, "OMP_NUM_THREADS": "1",
                              "SMP_FX_TIMEOUT_S": "120", "SM_HP_MP_PARAMETERS": json.dumps(
                                  {"partitions": 2, "microbatches": 2}), **env})
    assert res.returncode == 0, res.stderr[-4000:]


def _check(out: Path, launcher: str) -> None:
    from examples.launch.train_tiny import reference

    ref = reference()
    ranks = [json.loads((out / f"result_{r}.json").read_text(encoding="utf-8"))
             for r in range(2)]
    assert [r["ranks"][:4] for r in ranks] == [[r, 2, 0, 1] for r in range(2)]
    assert {r["launcher"] for r in ranks} == {launcher}
    for r in ranks:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        if r["params"]:
            torch.testing.assert_close(r["params"], ref["params"], rtol=1e-5, atol=1e-5)


@pytest.mark.multiproc
def test_slurm_sbatch_script(tmp_path: Path) -> None:
    out = tmp_path / "slurm"
    _run_script(tmp_path, "slurm.sbatch", ["examples/launch/train_tiny.py", str(out)],
                {"SLURM_JOB_ID": "4242", "MASTER_PORT": str(free_port())})
    _check(out, "slurm")


@pytest.mark.multiproc
def test_mpirun_script(tmp_path: Path) -> None:
    out = tmp_path / "mpirun"
    _run_script(tmp_path, "mpirun.sh", ["-np", "2", "-H", "localhost:1,localhost:1",
                                             "examples/launch/train_tiny.py", str(out)],
                {"MASTER_PORT": str(free_port())})
    _check(out, "mpirun")
