"""Train through lost and returning nodes: run it under a node range with restarts.

    smp-fx run -n 2 --nnodes 1:2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        --max-restarts 3 examples/train_elastic.py --ckpt /shared/ck --steps 10 --out final.pt

on each node. A two-stage pipeline trains a small MLP with data parallelism over whatever
processes the launcher gives it (pp 2 kept, dp = world / 2), a checkpoint every ``--every``
steps. After a restart, on fewer or more nodes, it resumes from the newest complete
checkpoint and goes on with the same global batch: each step's batch is a function of the
step alone, and each data-parallel rank takes its ``GLOBAL_BATCH / smp.dp_size()`` rows of
it, so the data continues from the step the checkpoint was at whatever the new degree
(docs/faults.md, 'Elastic resume'). ``--reference`` trains the same model in one process
with plain PyTorch on the same global batches.

``--stall-at K`` and ``--hold-at K`` are for tests: on torchelastic's first attempt, the
processes of the node started with ``ELASTIC_DOOMED=1`` write ``CKPT/doomed_{rank}`` (their
pid) at the start of step K and stop there, for the test to kill that node; at dp 1 every
process stops before step K of ``--hold-at``, until a returning node restarts the job.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GLOBAL_BATCH, LR = 16, 0.05


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: the same in every run, on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def optimizer_of(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reference(steps: int) -> dict[str, torch.Tensor]:
    model = build_model()
    opt = optimizer_of(model.parameters())
    for step in range(1, steps + 1):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def distributed(args: argparse.Namespace) -> dict[str, torch.Tensor] | None:
    import smp_fx as smp  # under smp-fx run: import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True})
    model = smp.DistributedModel(build_model())
    opt = smp.DistributedOptimizer(optimizer_of(model.parameters()))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    done = 0  # steps in the checkpoint resumed from
    if os.path.exists(os.path.join(args.ckpt, "newest")):
        done = int(smp.resume_from_checkpoint(args.ckpt)["step"])
        print(f"rank {smp.rank()}: resumed after step {done} at dp {smp.dp_size()}",
              flush=True)
    share = GLOBAL_BATCH // smp.dp_size()
    mine = slice(smp.dp_rank() * share, (smp.dp_rank() + 1) * share)
    for step in range(done + 1, args.steps + 1):
        _stall_if_doomed(args, step, smp.rank())
        if step == args.hold_at and smp.dp_size() == 1:
            time.sleep(300)  # a smaller world waits here to be restarted at a larger one
        x, y = batch(step)
        opt.zero_grad()
        train_step(model, x[mine], y[mine])
        opt.step()
        if step % args.every == 0:
            smp.save_checkpoint(args.ckpt, f"step{step}", partial=True, model=model,
                                optimizer=opt, user_content={"step": step},
                                num_kept_partial_checkpoints=2)
    state = model.state_dict()  # collective over the pipeline
    return state if smp.rank() == 0 else None


def _stall_if_doomed(args: argparse.Namespace, step: int, rank: int) -> None:
    if (step != args.stall_at or not os.environ.get("ELASTIC_DOOMED")
            or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        return
    with open(os.path.join(args.ckpt, f"doomed_{rank}"), "w", encoding="utf-8") as fh:
        fh.write(str(os.getpid()))
    time.sleep(300)  # killed long before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint folder (shared by all nodes)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=2, help="steps between checkpoints")
    ap.add_argument("--out", help="world rank 0 writes the final parameters here")
    ap.add_argument("--reference", action="store_true", help="plain PyTorch, one process")
    ap.add_argument("--stall-at", type=int, default=-1, help="(tests) see the docstring")
    ap.add_argument("--hold-at", type=int, default=-1, help="(tests) see the docstring")
    args = ap.parse_args()
    torch.set_num_threads(1)
    state = reference(args.steps) if args.reference else distributed(args)
    if state is not None and args.out:
        torch.save(state, args.out)


if __name__ == "__main__":
    main()
