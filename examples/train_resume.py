"""Train with checkpoints, crash, and resume: run it under ``smp-fx run --max-restarts``.

    smp-fx run -n 2 --max-restarts 1 examples/train_resume.py --ckpt /tmp/ck/model.pt \\
        --steps 8 --crash-at 5 --out /tmp/final.pt

A pipeline of two stages trains a small MLP for ``--steps`` steps. After every step it saves
a partial checkpoint (model, optimizer, the step) with ``smp.save``, whose commit protocol
keeps the last complete checkpoint loadable if a save is interrupted; at start it loads that
checkpoint, if there is one, and goes on with the step after it. ``--crash-at K`` kills
rank 1 (SIGKILL) in the middle of step K, on torchrun's first attempt only: rank 0 loses
its connection to it, torchrun restarts both, and they resume from step K - 1's
checkpoint. The batches are a function of the step, so the resumed run sees the same data
as an uninterrupted one and ends with the same parameters; rank 0 writes them to
``--out``. Run it without a launcher (one process, both stages in it) for the reference.

The checkpoint calls are the two functions ``save`` and ``resume``; nothing else in the
script knows how checkpoints are made.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import smp_fx as smp


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch: the same in every run and on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def save(path: str, model: Any, optimizer: Any, step: int) -> None:
    """The checkpoint of the state after ``step`` (every model-parallel rank calls it)."""
    smp.save({"model": model.local_state_dict(), "optimizer": optimizer.local_state_dict(),
              "step": step}, path, partial=True)


def resume(path: str, model: Any, optimizer: Any) -> int:
    """Load the last complete checkpoint, if any; the first step still to run."""
    if not os.path.exists(f"{path}.smp_index.json"):
        return 0
    ckpt = smp.load(path, partial=True)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    return int(ckpt["step"]) + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint path (partial files beside it)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--crash-at", type=int, default=-1, help="step in which rank 1 dies")
    ap.add_argument("--out", help="rank 0 writes the final parameters here")
    args = ap.parse_args()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    torch.set_num_threads(1)
    model = smp.DistributedModel(build_model())
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    step = 0

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = model(x)
        loss = F.mse_loss(out, y)
        model.backward(loss)
        if step == args.crash_at and first_attempt and smp.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the other microbatch is pending
        return loss

    start = resume(args.ckpt, model, optimizer)
    if start:
        print(f"rank {smp.rank()}: resumed at step {start}", flush=True)
    for step in range(start, args.steps):
        optimizer.zero_grad()
        train_step(model, *batch(step))
        optimizer.step()
        save(args.ckpt, model, optimizer, step)
    state = model.state_dict()  # collective over the pipeline
    if args.out and smp.rank() == 0:
        torch.save(state, args.out)


if __name__ == "__main__":
    main()
