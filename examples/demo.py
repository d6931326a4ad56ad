"""smp-fx demo: partition the GPT-2-style example into 2 stages, then train it on 2 processes.

Run: ``python examples/demo.py`` (``make demo``). Part 1 prints the partition plan the
compiler makes (the same table as ``smp-fx partition``) and where SMP's placement strategies
put 8 ranks. Part 2 launches 2 gloo processes with ``smp-fx run`` (torchrun underneath),
which train the model for a few steps through ``smp.step`` and print the loss.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def show_plan() -> None:
    from models import gpt

    from passes.partition_config import PartitionConfig
    from passes.pipeline import compile_model
    from smp_fx.cli.render import format_table

    torch.manual_seed(0)
    model = gpt.build_model()
    ids = gpt.example_inputs(4)
    compiled = compile_model(model, (ids[0][:1],), None,
                             PartitionConfig(num_stages=2, microbatches=4), device="cpu")
    print("== partition plan: GPT-2-style model, 2 stages, 4 microbatches (cpu costs) ==")
    print(format_table(compiled.plan))
    print()


def show_topology() -> None:
    from smp_fx.config import load_config, resolve_topology

    cfg = load_config({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
                       "placement_strategy": "cluster"}, env={})
    topo, _ = resolve_topology(cfg, 8)
    print("== 8 ranks, pp = tp = rdp = 2, placement_strategy='cluster' ==")
    print(topo.table())
    print()


def train() -> None:
    print("== training on 2 processes: smp-fx run -n 2 examples/train_gpt.py ==", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "smp_fx.cli.main", "run", "-n", "2", "--backend", "gloo",
           str(HERE / "train_gpt.py"), "--steps", "15"]
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=600)
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("step")))
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(proc.returncode)


def main() -> None:
    show_plan()
    show_topology()
    train()


if __name__ == "__main__":
    main()
