"""``smp-fx plan --hf-config`` on Llama-3-8B-, Llama-3-70B- and Mixtral-8x7B-shaped configs.

For each config in ``examples/configs/`` (public shapes, no weights): build and trace
(three layers, ``smp_fx.planner.hf_config``), then search the plans for a DGX H100
cluster at 8192 tokens per sample; prints the layers and parameters found, the time to
prepare and to search (wall and this process's CPU time: on a shared machine the wall
time measures the neighbours too), and the best plan's MFU and memory per GPU.

    .venv/bin/python benchmarks/plan_hf.py [--seq-len 8192] [--cluster dgx-h100]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from cost_model.cluster import load_cluster
from smp_fx.planner.hf_config import prepare_config
from smp_fx.planner.planner import plan
from smp_fx.planner.step import Setting

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
RUNS = (("llama3-8b", 64, 256), ("llama3-70b", 512, 512), ("mixtral-8x7b", 128, 512))
"""(config, GPUs, global batch in samples)."""
GiB = 1024**3
P = ParamSpec("P")
T = TypeVar("T")


def timed(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> tuple[T, float, float]:
    """``fn``'s result, wall seconds, this process's CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--cluster", default="dgx-h100")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    print(f"{'config':14s} {'layers':>6s} {'params':>8s} {'prepare s (cpu)':>16s} "
          f"{'search s (cpu)':>15s} {'candidates':>10s}  best plan")
    for name, gpus, batch in RUNS:
        prepared, pw, pc = timed(prepare_config, CONFIGS / f"{name}.json", args.seq_len)
        setting = Setting(cluster, gpus, batch, "bf16", 1.0, step_temporary=True)
        planned, sw, sc = timed(plan, prepared, setting, top_k=1)
        best, info = planned.best, prepared.info
        print(f"{name:14s} {info.layers:6d} {info.parameters / 1e9:7.2f}B "
              f"{pw:7.1f} ({pc:5.1f}) {sw:7.1f} ({sc:5.1f}) "
              f"{planned.result.considered:10,d}  {gpus} GPUs x {batch}: "
              f"{best.candidate.label()}, MFU {best.mfu:.1%}, "
              f"{best.memory_bytes_per_gpu / GiB:.1f} GiB/GPU")


if __name__ == "__main__":
    main()
