"""An SMP script small enough to launch anywhere: a 4-layer MLP, 3 steps of SGD at
pp = 2 x dp = 2 (or whatever ``SM_HP_MP_PARAMETERS`` / ``smp.init`` reads), each
data-parallel replica on its own shard of a fixed global batch.

The launch scripts beside it start it on several hosts (``slurm.sbatch``: ``srun``;
``mpirun.sh``: Open MPI; ``two_launchers.sh``: ``smp-fx run --nnodes 2``). Every rank
writes ``OUT/result_{rank}.json``: its ranks, the losses, and (data-parallel rank 0 of
each pipeline rank) the whole model's parameters after training.
``python train_tiny.py OUT --reference`` trains the same model in one process with plain
PyTorch on the global batches, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

GLOBAL_BATCH, STEPS, LR = 16, 3, 0.1


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 1, generator=g))
            for _ in range(STEPS)]


def values(state: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in state.items()}


def reference() -> dict[str, object]:
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": values(model.state_dict())}


def distributed() -> dict[str, object]:
    import smp_fx as smp  # under smp-fx run: import smdistributed.modelparallel.torch as smp

    smp.init()  # SM_HP_MP_PARAMETERS, as on SageMaker; the launcher from the environment
    model = smp.DistributedModel(build())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    shard = GLOBAL_BATCH // smp.dp_size()
    losses = []
    for x, y in batches():
        mine = slice(smp.dp_rank() * shard, (smp.dp_rank() + 1) * shard)
        opt.zero_grad()
        out = train_step(model, x[mine], y[mine]).reduce_mean()
        opt.step()
        # the global batch's loss: the mean of the replicas' (equal-sized) shard losses
        losses.append(sum(smp.allgather(out.item(), smp.DP_GROUP)) / smp.dp_size())
    state = model.state_dict() if smp.dp_rank() == 0 else {}
    launch = smp.state.get().launch
    return {"losses": losses, "params": values(state), "launcher": launch.launcher,
            "ranks": [smp.rank(), smp.size(), smp.local_rank(), smp.local_size(),
                      smp.pp_rank(), smp.dp_rank()]}


if __name__ == "__main__":
    torch.set_num_threads(1)
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("out")
    cli.add_argument("--reference", action="store_true")
    ns = cli.parse_args()
    found = reference() if ns.reference else distributed()
    rank = 0 if ns.reference else found["ranks"][0]  # type: ignore[index]
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, f"result_{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(found, fh)
