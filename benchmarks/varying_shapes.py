"""Step time with varying batch sizes and sequence lengths vs fixed shapes, pp=2.

The tiny Hugging Face Llama of ``examples/models/hf_llama.py`` (export-captured, so its
graph keeps batch and sequence dimensions symbolic) at ``pipeline_parallel_degree`` 2 in one
process, partitioned once. Each shape of ``SHAPES`` is first stepped once (the time of the
first step of a new shape), then two kinds of rounds alternate: a *varying* round steps
once in each shape, cycling (dynamic padding, a short last batch), and a *fixed* round
steps once in a single shape, taking each shape in turn. The figure is the ratio of the
sums over shapes of the median step time, varying / fixed (target: within 10 %), so both
sides do the same work; rounds alternate so load on a shared machine hits both alike.

    python benchmarks/varying_shapes.py [--rounds 15] [--layers 4] [--hidden 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = ((8, 32), (8, 24), (4, 32), (6, 24), (2, 16))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=2)
    args = ap.parse_args()
    import smp_fx as smp
    from smp_fx.cli.partition import load_model_file

    torch.set_num_threads(1)
    ex = load_model_file(str(Path(__file__).resolve().parents[1]
                             / "examples/models/hf_llama.py"))
    smp.init({"pipeline_parallel_degree": 2, "microbatches": args.microbatches,
              "pipeline": "interleaved"})
    torch.manual_seed(0)
    model = smp.DistributedModel(ex.build_model(num_hidden_layers=args.layers,
                                                hidden_size=args.hidden))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = ex.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    batches = {s: (torch.randint(0, ex.VOCAB, s), torch.randint(0, ex.VOCAB, s))
               for s in SHAPES}

    def step(shape: tuple[int, int]) -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        train_step(model, *batches[shape])
        opt.step()
        return time.perf_counter() - t0

    first = {s: step(s) for s in SHAPES}  # SHAPES[0]'s includes tracing and partitioning
    fixed: dict[tuple[int, int], list[float]] = {s: [] for s in SHAPES}
    varying: dict[tuple[int, int], list[float]] = {s: [] for s in SHAPES}
    for r in range(args.rounds):
        for s in SHAPES:  # varying: every shape in turn
            varying[s].append(step(s))
        s = SHAPES[r % len(SHAPES)]  # fixed: one shape, as many steps as a varying round
        for _ in SHAPES:
            fixed[s].append(step(s))
    assert model.plan is not None
    print(f"tiny Llama, {args.layers} layers x {args.hidden}, pp=2, "
          f"{args.microbatches} microbatches, {args.rounds} rounds; median step ms")
    print(f"{'shape':>10} {'first step':>11} {'fixed':>8} {'varying':>8} {'ratio':>6}")
    for s in SHAPES:
        f, v = statistics.median(fixed[s]), statistics.median(varying[s])
        print(f"{str(s):>10} {first[s] * 1e3:11.1f} {f * 1e3:8.2f} {v * 1e3:8.2f} "
              f"{v / f:6.3f}")
    tf = sum(statistics.median(fixed[s]) for s in SHAPES)
    tv = sum(statistics.median(varying[s]) for s in SHAPES)
    later = [first[s] * 1e3 for s in SHAPES[1:]]
    print(f"varying / fixed (sum of medians): {tv / tf:.3f} (target <= 1.10)")
    print(f"first step of a new shape: {min(later):.1f}-{max(later):.1f} ms "
          f"(steady {tf / len(SHAPES) * 1e3:.1f} ms mean of medians); the first step of "
          f"all (trace + plan): {first[SHAPES[0]]:.2f} s")


if __name__ == "__main__":
    main()
