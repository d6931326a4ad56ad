"""How fast a failed job ends, and that a crashed job resumes to the uninterrupted result.

Three measurements, each under ``smp-fx run`` on this machine (gloo):

* **kill**: at step 3 the last rank SIGKILLs itself; the time from just before the kill to
  the launcher's exit (every process gone). Target <= 10 s, on 2 and 4 processes.
* **hang**: at step 3 the last rank sleeps (alive, not progressing) under
  ``SMP_FX_TIMEOUT_S=20``; the time from the start of the sleep to the launcher's exit.
  Target <= timeout + 10 s.
* **resume**: ``examples/train_resume.py`` killed mid-run under ``--max-restarts 1`` ends
  with the parameters of an uninterrupted run (bitwise).

Each kill / hang time is the median of ``--repeat`` runs. Usage::

    .venv/bin/python benchmarks/faults.py [--repeat 3] [--procs 2 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 20

SCRIPT = """
import os, signal, sys, time
import torch
from torch import nn
import smdistributed.modelparallel.torch as smp

mode, mark = sys.argv[1], sys.argv[2]
smp.init({"pipeline_parallel_degree": int(os.environ["WORLD_SIZE"]), "microbatches": 2})
os.environ["SMP_FX_TIMEOUT_S"] = os.environ["PIPELINE_TIMEOUT_S"]
torch.set_num_threads(1)
torch.manual_seed(0)
model = smp.DistributedModel(nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]))
last = smp.size() - 1

@smp.step
def train(model, x, k):
    if k == 3 and smp.rank() == last:
        with open(mark, "w") as f:
            f.write(repr(time.time()))
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    out = model(x)
    model.backward(out.sum())
    return out

for k in range(100):
    train(model, torch.randn(8, 16), k)
"""


def fault_time(mode: str, procs: int, work: Path) -> float:
    """Seconds from the fault (the mark written by the failing rank) to the launcher's exit."""
    script, mark = work / "fault.py", work / f"{mode}{procs}.mark"
    script.write_text(textwrap.dedent(SCRIPT))
    mark.unlink(missing_ok=True)
    env = {**os.environ, "SMP_FX_TIMEOUT_S": "120", "PIPELINE_TIMEOUT_S": str(TIMEOUT_S),
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "smp_fx.cli.main", "run", "-n", str(procs),
                          str(script), mode, str(mark)], cwd=work, env=env,
                         capture_output=True, text=True, timeout=600)
    ended = time.time()
    if res.returncode == 0 or not mark.exists():
        raise RuntimeError(f"{mode} at {procs} processes did not fail as planned:\n"
                           f"{res.stderr[-2000:]}")
    return ended - float(mark.read_text())


def resume_equal(work: Path) -> bool:
    """The crash-resumed run's final parameters equal the uninterrupted run's, bitwise."""
    script = str(REPO / "examples" / "train_resume.py")
    common = ["--steps", "5"]
    subprocess.run([sys.executable, script, "--ckpt", str(work / "ref.pt"), *common,
                    "--out", str(work / "ref_final.pt")], check=True, capture_output=True,
                   timeout=300)
    subprocess.run([sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2",
                    "--max-restarts", "1", script, "--ckpt", str(work / "ck.pt"), *common,
                    "--crash-at", "2", "--out", str(work / "final.pt")], check=True,
                   capture_output=True, cwd=work, timeout=300)
    want, got = torch.load(work / "ref_final.pt"), torch.load(work / "final.pt")
    return want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    ok = True
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"median of {args.repeat} run(s)")
    print(f"{'fault':6s} {'procs':>5s} {'to exit s':>10s} {'target s':>9s}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode, target in (("kill", 10.0), ("hang", TIMEOUT_S + 10.0)):
            for procs in args.procs:
                t = statistics.median(fault_time(mode, procs, work) for _ in range(args.repeat))
                ok &= t <= target
                print(f"{mode:6s} {procs:5d} {t:10.1f} {target:9.0f}")
        equal = resume_equal(work)
        ok &= equal
        print(f"crash-resume final parameters equal to the uninterrupted run: {equal}")
    print("all targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
