"""Compiled stages (``compile``) beside eager ones: the step, the first step's compile time
and the recompiles of varying sequence lengths, at pp 2 on 2 gloo processes.

The example GPT (``examples/models/gpt.py``) and the tiny Hugging Face Llama
(``examples/models/hf_llama.py``), each under 1F1B (``interleaved`` v = 1), interleaved
v = 2 and ZB-V, one intra-op thread per process, SGD. Per configuration: an eager model,
then a compiled one (each its own ``smp.init``: one configuration per process at a time, so
they cannot alternate), each stepped ``--steps`` times after its first step; each figure is
the median over those steps. The first
step's compile time is the compiled model's first step less its median step. Then the
compiled model steps once at each of 5 other sequence lengths: the recompiles that adds
(summed over the stages of both ranks; dynamo makes the dimension dynamic at the first new
length) and how many stages run eagerly (ZB-V: the chunks that receive gradients).

    python benchmarks/compile_stages.py [--backend inductor] [--steps 7] [--models gpt,llama]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEDULES = (("1F1B", "interleaved", 1), ("interleaved v=2", "interleaved", 2),
             ("ZB-V", "zbv", 2))
LENGTHS = (48, 40, 56, 24, 32)  # after --seq (64): 5 new sequence lengths


def _model(name: str, args: argparse.Namespace) -> tuple[Any, torch.nn.Module]:
    from smp_fx.cli.partition import load_model_file

    ex = load_model_file(str(ROOT / "examples/models" / f"{name}.py"))
    torch.manual_seed(0)
    if name == "gpt":
        return ex, ex.build_model(n_layer=args.layers, n_embd=args.hidden, n_head=4,
                                  seq_len=args.seq)
    return ex, ex.build_model(num_hidden_layers=args.layers, hidden_size=args.hidden)


class _Run:
    """One DistributedModel (eager or compiled) and its step on a batch of a given length."""

    def __init__(self, name: str, pipeline: str, v: int, backend: str,
                 args: argparse.Namespace) -> None:
        import smp_fx as smp
        from smp_fx.world import state

        state._reset()
        smp.init({"pipeline_parallel_degree": 2, "microbatches": args.microbatches,
                  "pipeline": pipeline, "virtual_pipeline_degree": v, "compile": backend})
        self.ex, model = _model(name, args)
        self.model = smp.DistributedModel(model)
        self.opt = smp.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=1e-3))
        self.vocab = 128
        ex = self.ex

        @smp.step
        def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
            loss = ex.loss_fn(model(x), y)
            model.backward(loss)
            return loss

        self.train_step = train_step
        self.args = args

    def step(self, length: int) -> float:
        g = torch.Generator().manual_seed(length)
        x = torch.randint(0, self.vocab, (self.args.batch, length), generator=g)
        y = torch.randint(0, self.vocab, (self.args.batch, length), generator=g)
        dist.barrier()
        start = time.perf_counter()
        self.train_step(self.model, x, y)
        self.opt.step()
        self.opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - start

    def counts(self) -> tuple[int, int]:
        """(recompiles, stages running eagerly) over both ranks."""
        stats = self.model.parallelized.compiled.values()
        got = torch.tensor([sum(s.recompiles for s in stats),
                            sum(s.fallback is not None for s in stats)])
        dist.all_reduce(got)
        return int(got[0]), int(got[1])


def _row(name: str, label: str, pipeline: str, v: int, args: argparse.Namespace
         ) -> dict[str, Any]:
    eager = _Run(name, pipeline, v, "none", args)
    eager.step(args.seq)
    e = statistics.median(eager.step(args.seq) for _ in range(args.steps))
    compiled = _Run(name, pipeline, v, args.backend, args)  # smp.init anew: eager is done
    first = compiled.step(args.seq)
    c = statistics.median(compiled.step(args.seq) for _ in range(args.steps))
    before, _ = compiled.counts()
    for n in LENGTHS:
        compiled.step(n)
    after, eager_stages = compiled.counts()
    return {"model": name, "schedule": label, "eager_ms": e * 1e3, "compiled_ms": c * 1e3,
            "ratio": c / e, "compile_s": first - c, "recompiles": after - before,
            "eager_stages": eager_stages}


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configuration's row, on this rank (one of ``run_ranks``'s two)."""
    dist.init_process_group("gloo")
    return [_row(name, label, pipeline, v, args) for name in args.models.split(",")
            for label, pipeline, v in SCHEDULES if label in args.schedules.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--models", default="gpt,hf_llama")
    ap.add_argument("--schedules", default=",".join(label for label, _, _ in SCHEDULES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4)
    args = ap.parse_args()
    from tests.helpers.dist import run_ranks

    rows = run_ranks(_rows, 2, args, timeout=3600)[0]
    print(f"compile={args.backend}, pp 2 on 2 gloo processes, {args.layers} layers, hidden "
          f"{args.hidden}, batch {args.batch} x {args.seq}, {args.microbatches} microbatches; "
          f"medians of {args.steps} steps")
    print(f"{'model':<9} {'schedule':<16} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} "
          f"{'compile s':>10} {'recompiles/5 lengths':>21} {'eager stages':>13}")
    for r in rows:
        print(f"{r['model']:<9} {r['schedule']:<16} {r['eager_ms']:>9.1f} "
              f"{r['compiled_ms']:>12.1f} {r['ratio']:>6.2f} {r['compile_s']:>10.1f} "
              f"{r['recompiles']:>21d} {r['eager_stages']:>13d}")


if __name__ == "__main__":
    main()
