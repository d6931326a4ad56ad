"""The example scripts run as one process and under ``smp-fx run`` / torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], timeout: float = 240) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", SMP_FX_TIMEOUT_S="120")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [float(line.split()[-1]) for line in proc.stdout.splitlines()
            if line.startswith("step ")]


@pytest.mark.multiproc
@pytest.mark.parametrize("flags", [[], ["--manual"]])
def test_mnist_example_one_process(flags: list[str]) -> None:
    losses = _run([sys.executable, "examples/train_mnist.py", "--steps", "2", "--batch-size",
                   "16", *flags])
    assert len(losses) == 2


@pytest.mark.multiproc
def test_gpt_example_learns_in_one_process() -> None:
    losses = _run([sys.executable, "examples/train_gpt.py", "--steps", "12"])
    assert len(losses) == 4 and losses[-1] < losses[0]


@pytest.mark.multiproc
def test_gpt_example_under_smp_fx_run() -> None:
    losses = _run([sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2", "--backend",
                   "gloo", "examples/train_gpt.py", "--steps", "6", "--pipeline", "simple"])
    assert len(losses) == 2 and losses[-1] < losses[0]  # steps 0 and 5 are printed
