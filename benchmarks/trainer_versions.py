"""The Hugging Face Trainer's SMP mode across transformers versions: losses beside the plain
Trainer's.

For each version (4.26.1, 4.46.3 and the project's pin by default) a virtual environment of
its own (the pinned CPU torch, that transformers, a matching accelerate, smp-fx editable;
built once under ``--venvs``, the pin's is the running interpreter), and in it
``examples/hf_trainer.py`` twice at once: the plain Trainer in one process and the Trainer
in SMP mode at pp = 2 on 2 processes (``smp-fx run -n 2``). Prints, per version and run
(``gas1``: gradient accumulation 1; ``resumed``: resumed from step 2; ``gas2``: accumulation
2; then the evaluation losses), the plain losses, smp-fx's and their largest difference.
Under 4.46 the plain run divides the accumulated losses as the other versions do
(``--average-accumulation``, docs/clients.md).

    python benchmarks/trainer_versions.py [--versions 4.26.1 4.46.3 pin] [--venvs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from examples.hf_trainer import plain_sums_accumulation  # noqa: E402

SCRIPT = REPO / "examples" / "hf_trainer.py"
TORCH_SPEC = "torch==2.13.0"
EXTRA = {  # what each transformers version is installed with
    "4.26.1": ["transformers==4.26.1"],
    "4.46.3": ["transformers==4.46.3", "accelerate==1.1.1"],
}
SMP_ENV = {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "microbatches": 2}),
           "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True})}
RUNS = ("gas1", "resumed", "gas2")
EVALS = ("eval", "gas2_evals", "best")


def python_for(version: str, venvs: Path) -> str:
    """The interpreter of ``version``'s environment, built on first use."""
    if version == "pin":
        return sys.executable
    env = venvs / f"transformers-{version}"
    py = env / "bin" / "python"
    stamp = env / ".installed"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, TORCH_SPEC], check=True)
        subprocess.run([*pip, *EXTRA[version], "networkx", "numpy"], check=True)
        subprocess.run([*pip, "--no-deps", "-e", str(REPO)], check=True)
        stamp.touch()
    return str(py)


def run_pair(py: str, out: Path) -> tuple[dict, dict]:
    """The plain and the SMP-mode results (rank 0's) of one environment."""
    base = {k: v for k, v in os.environ.items() if k not in SMP_ENV}
    # transformers 4.x reads its own RNG-state files with torch.load's pre-2.6 default
    base.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", SMP_FX_TIMEOUT_S="600",
                TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    smp = subprocess.Popen([py, "-m", "smp_fx.cli.main", "run", "-n", "2", str(SCRIPT),
                            str(out / "smp")], cwd=REPO, env={**base, **SMP_ENV},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # 4.46's plain Trainer sums accumulated gradients; its SMP branch averages them
    # (docs/clients.md): the plain run that averages is the one to compare with
    average = ["--average-accumulation"] if plain_sums_accumulation(version_of(py)) else []
    plain = subprocess.run([py, str(SCRIPT), str(out / "plain"), *average], cwd=REPO,
                           env=base, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    _, smp_err = smp.communicate(timeout=1800)
    for name, code, err in (("plain", plain.returncode, plain.stderr),
                            ("smp-fx", smp.returncode, smp_err)):
        if code != 0:
            raise SystemExit(f"{py}: the {name} run failed:\n{err[-3000:]}")
    read = (lambda p: json.loads(p.read_text(encoding="utf-8")))
    return read(out / "plain" / "result_0.json"), read(out / "smp" / "result_0.json")


def version_of(py: str) -> str:
    return subprocess.run([py, "-c", "import transformers; print(transformers.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:.5f}" for v in values)


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--versions", nargs="+", default=["4.26.1", "4.46.3", "pin"])
    cli.add_argument("--venvs", type=Path, default=REPO / "out" / "trainer-venvs")
    ns = cli.parse_args()
    rows = []
    for version in ns.versions:
        py = python_for(version, ns.venvs)
        with tempfile.TemporaryDirectory(prefix="trainer-versions-") as tmp:
            plain, smp = run_pair(py, Path(tmp))
        rows.append((version_of(py), plain, smp))
    print(f"{'transformers':<13}{'run':<11}{'plain Trainer':<38}{'smp-fx pp=2':<38}max |diff|")
    for version, plain, smp in rows:
        for run in RUNS + EVALS:
            want = plain[run] if isinstance(plain[run], list) else [plain[run]]
            got = smp[run] if isinstance(smp[run], list) else [smp[run]]
            diff = (max(abs(a - b) for a, b in zip(want, got)) if len(want) == len(got)
                    else float("inf"))
            print(f"{version:<13}{run:<11}{fmt(want):<38}{fmt(got):<38}{diff:.1e}")


if __name__ == "__main__":
    main()
