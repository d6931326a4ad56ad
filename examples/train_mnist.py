"""Train a GroupedNet (MNIST-style CNN) with smp-fx, following SMP's example scripts.

Synthetic MNIST-shaped data (no download), 2 pipeline stages, 4 microbatches. Automatic
partitioning by default; ``--manual`` places the modules as SMP's manual-partitioning
script does (created inside ``with smp.partition(i):``, ``auto_partition`` false) and prints
each stage's modules. Any of these runs it::

    python examples/train_mnist.py [--manual]                # one process, stages in-process
    smp-fx run -n 2 examples/train_mnist.py                  # 2 processes (gloo on CPU)
    torchrun --nproc-per-node 2 examples/train_mnist.py
    torchrun --nproc-per-node 4 examples/train_mnist.py      # pp=2 x dp=2 (ddp)

Under ``smp-fx run`` the SageMaker import name works too:
``import smdistributed.modelparallel.torch as smp``.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, Subset, TensorDataset

import smp_fx as smp  # or: import smdistributed.modelparallel.torch as smp (under smp-fx run)


class GroupedNet(nn.Module):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()

        def partition(i: int) -> contextlib.AbstractContextManager[object]:
            return smp.partition(i) if manual else contextlib.nullcontext()

        with partition(0):  # the convolutions
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
        with partition(1):  # the classifier
            self.dropout1 = nn.Dropout(0.25)
            self.dropout2 = nn.Dropout(0.5)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(n: int, seed: int = 0) -> TensorDataset:
    """28x28 images: a class-specific pattern plus noise, so the loss can go down."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(10, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = prototypes[labels] + 0.5 * torch.randn(n, 1, 28, 28, generator=g)
    return TensorDataset(images, labels)


# smdistributed: Define smp.step. Return any tensors needed outside.
@smp.step
def train_step(model: smp.DistributedModel, data: torch.Tensor, target: torch.Tensor):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


def train(model: smp.DistributedModel, device: torch.device, train_loader: DataLoader,
          optimizer: optim.Optimizer, steps: int) -> list[float]:
    model.train()
    losses = []
    for batch_idx, (data, target) in enumerate(train_loader):
        if batch_idx == steps:
            break
        # smdistributed: Move input tensors to the device used by the current process.
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        # Return value, loss_mb is a StepOutput object
        _, loss_mb = train_step(model, data, target)
        # smdistributed: Average the loss across microbatches.
        loss = loss_mb.reduce_mean()
        optimizer.step()
        losses.append(loss.item())
        if smp.rank() == 0:
            print(f"step {batch_idx} loss {loss.item():.4f}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--manual", action="store_true", help="place modules with smp.partition")
    args = ap.parse_args(argv)
    torch.manual_seed(0)

    # smdistributed: initialize the backend
    # ("ddp": true: with 4 processes, pp=2 x dp=2 replicas whose gradients are averaged)
    placement = {"auto_partition": False, "default_partition": 0} if args.manual else {}
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "interleaved",
              "ddp": True, **placement})

    # smdistributed: Set the device to the GPU ID used by the current process.
    if torch.cuda.is_available():
        torch.cuda.set_device(smp.local_rank())
        device = torch.device("cuda")
    else:
        device = torch.device("cpu")

    dataset = synthetic_mnist(args.batch_size * args.steps)
    # smdistributed: Shard the dataset based on data-parallel ranks
    if smp.dp_size() > 1:
        dataset = Subset(dataset, range(smp.dp_rank(), len(dataset), smp.dp_size()))

    # smdistributed: Set drop_last=True so the batch size is divisible by the microbatches
    train_loader = DataLoader(dataset, batch_size=args.batch_size, drop_last=True)

    model = GroupedNet(manual=args.manual)
    optimizer = optim.Adadelta(model.parameters(), lr=1.0)

    # smdistributed: Use the DistributedModel container to provide the model to be
    # partitioned; use the returned object in place of the model from here on.
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    losses = train(model, device, train_loader, optimizer, args.steps)
    if args.manual and smp.rank() == 0:
        for stage in model.program.stages:
            owners = sorted({n.split(".")[0] for n, _ in stage.module.named_parameters()})
            print(f"stage {stage.index}: {owners}")
    return losses


if __name__ == "__main__":
    main()
