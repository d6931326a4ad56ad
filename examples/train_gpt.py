"""Train the GPT-2-style example model (tied embedding / LM head) with smp-fx.

Synthetic next-token data (each sequence counts up modulo the vocabulary), 2 pipeline
stages, 4 microbatches. The token embedding and the LM head share one weight: when they
land on different stages each holds a replica and smp-fx sums their gradients. Runs as::

    python examples/train_gpt.py                      # one process, stages in-process
    smp-fx run -n 2 examples/train_gpt.py             # 2 processes (gloo on CPU)
    torchrun --nproc-per-node 2 examples/train_gpt.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import smp_fx as smp  # or: import smdistributed.modelparallel.torch as smp (under smp-fx run)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models.gpt import GPTConfig, build_model  # noqa: E402


def batches(batch_size: int, steps: int, cfg: GPTConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=g)
        seq = (start + torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
        yield seq[:, :-1], seq[:, 1:]


@smp.step
def train_step(model: smp.DistributedModel, ids: torch.Tensor, target: torch.Tensor):
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    model.backward(loss)
    return loss


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--pipeline", default="interleaved", choices=("simple", "interleaved"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": args.pipeline})
    device = torch.device("cuda", smp.local_rank()) if torch.cuda.is_available() \
        else torch.device("cpu")
    cfg = GPTConfig()
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    losses = []
    for step, (ids, target) in enumerate(batches(args.batch_size, args.steps, cfg)):
        optimizer.zero_grad()
        loss = train_step(model, ids.to(device), target.to(device)).reduce_mean()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if smp.rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
