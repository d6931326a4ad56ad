"""Expert parallelism on 2 gloo processes: load per expert, step time, all-to-all bytes.

A Mixtral of ``examples/models/moe_zoo.py`` made larger (``--hidden``, ``--experts``,
``--seq``) trains ``--steps`` SGD steps at dp 2 twice on the same 2 processes: with every
expert on every rank (``expert_parallel_degree: 1``, Hugging Face's experts) and with the
experts split (``expert_parallel_degree: 2``). Printed per rank: the median step time of
each (the first two steps, partitioning and warm-up, not timed), the rows each local expert
ran on per step at ep 2 (the load histogram, the backward's recomputation included), and
the bytes this rank's all-to-alls sent to the other rank per step beside the model's count
for uniform routing: 6 exchanges (dispatch and combine, in forward, in the backward's
recomputation and as gradients) x layers x local tokens x top-k x (ep - 1) / ep x hidden
x 4 bytes.

    python benchmarks/expert_parallel.py                 # ~2 min on 2 free cores
    python benchmarks/expert_parallel.py --hidden 256 --experts 8 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.models import moe_zoo  # noqa: E402
from tests.helpers.dist import run_ranks  # noqa: E402


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    return {"hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
            "num_local_experts": args.experts, "num_experts_per_tok": args.top_k,
            "num_hidden_layers": args.layers, "vocab_size": 256}


def _run(ep: int, args: argparse.Namespace) -> dict[str, Any]:
    import smp_fx as smp
    from smp_fx.parallel.ep_dispatch import counting
    from smp_fx.world import state

    state._reset()
    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "expert_parallel_degree": ep})
    model = smp.DistributedModel(moe_zoo.build("mixtral", **_sizes(args)))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        model.backward(loss)
        return loss

    per_rank = args.batch // smp.dp_size()
    torch.manual_seed(smp.rank())
    x = torch.randint(0, 256, (per_rank, args.seq))
    y = torch.randint(0, 256, (per_rank, args.seq))
    times = []
    with counting() as traffic:
        for step in range(args.steps + 2):
            if step == 2:
                traffic.rows_sent = traffic.bytes_sent = 0
                traffic.rows_per_expert = []
            start = time.perf_counter()
            opt.zero_grad()
            train_step(model, x, y)
            opt.step()
            if step >= 2:
                times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "bytes": traffic.bytes_sent // args.steps,
            "rows_per_expert": [r // args.steps for r in traffic.rows_per_expert],
            "tokens": per_rank * args.seq}


def _body(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return {"replicated": _run(1, args), "ep2": _run(2, args)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch (2 ranks)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    results = run_ranks(_body, 2, args, timeout=1200)
    print(f"Mixtral, hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, "
          f"{args.layers} layers, {args.batch} x {args.seq} tokens per step, 2 gloo ranks, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    for rank, r in enumerate(results):
        rep, ep2 = r["replicated"], r["ep2"]
        model_bytes = (6 * args.layers * ep2["tokens"] * args.top_k * (2 - 1) / 2
                       * args.hidden * 4)
        print(f"rank {rank}: step {rep['median_s'] * 1e3:.1f} ms replicated, "
              f"{ep2['median_s'] * 1e3:.1f} ms at ep 2; rows per local expert per step "
              f"{ep2['rows_per_expert']}; all-to-all sent {ep2['bytes'] / 1e6:.3f} MB per "
              f"step (uniform routing: {model_bytes / 1e6:.3f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
