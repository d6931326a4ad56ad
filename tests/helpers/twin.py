"""An smp-fx model on this rank beside the unpartitioned reference trained on the batch of
every data-parallel rank.

``Twin`` gives each dp rank its own slice of one seeded batch, so data-parallel averaging
is tested for real (equal slices would hide a sum where a mean belongs); the reference runs
the whole batch in one process. For the example models without batch statistics (mlp,
gpt) that is exactly what smp-fx computes. ``init`` re-initialises smp in a world that is
already joined, so one multi-process test can go through several configurations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import smp_fx as smp
from smp_fx.world import state
from tests.helpers.models import example


def init(pp: int, m: int, **extra: Any) -> None:
    """(Re-)initialise smp in the joined world with this configuration."""
    state._reset()
    smp.init({"pipeline_parallel_degree": pp, "microbatches": m, "ddp": True, **extra})


class Twin:
    """``dm`` (a DistributedModel) and ``ref`` from the same weights; see the module doc."""

    def __init__(self, name: str, per_rank: int = 4, seed: int = 0) -> None:
        self.ex = ex = example(name)
        torch.manual_seed(seed)
        self.ref = ex.build_model()
        model = ex.build_model()
        model.load_state_dict(self.ref.state_dict())
        self.initial = {k: v.clone() for k, v in self.ref.state_dict().items()}
        torch.manual_seed(seed + 1)
        dp, r = smp.dp_size(), smp.dp_rank()
        self.x = ex.example_inputs(per_rank * dp)
        self.y = ex.example_targets(per_rank * dp)
        self.x_local = tuple(t[r * per_rank:(r + 1) * per_rank] for t in self.x)
        self.y_local = self.y[r * per_rank:(r + 1) * per_rank]
        self.dm = smp.DistributedModel(model)

        @smp.step
        def train_step(model: Any, *args: Any) -> Any:
            *inputs, y = args
            loss = ex.loss_fn(model(*inputs), y)
            model.backward(loss)
            return loss

        self.train_step = train_step

    def smp_step(self, autocast: torch.dtype | None = None) -> float:
        """One smp.step on this rank's slice; the loss averaged over the dp ranks (the
        whole batch's, as the reference's)."""
        if autocast is None:
            out = self.train_step(self.dm, *self.x_local, self.y_local)
        else:
            with torch.autocast("cpu", dtype=autocast):
                out = self.train_step(self.dm, *self.x_local, self.y_local)
        loss = out.reduce_mean().detach().float()
        dist.all_reduce(loss, group=smp.get_dp_process_group())
        return float(loss) / smp.dp_size()

    def ref_step(self, autocast: torch.dtype | None = None) -> float:
        """The reference's forward and backward on the whole batch (under ``autocast``, as
        ``smp_step`` runs its step function); its loss."""
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = self.ex.loss_fn(self.ref(*self.x), self.y)
            loss.backward()
        return float(loss.detach())

    def local(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        """This rank's parameters (or gradients), whole (sharded ones gathered)."""
        out: dict[str, torch.Tensor | None] = {}
        for n, p in self.dm.local_named_parameters():
            t = p.grad if grads else p
            out[n] = None if t is None else _whole(t).detach().float()
        return out

    def reference(self, grads: bool = False) -> dict[str, torch.Tensor | None]:
        return {n: (p.grad if grads else p) for n, p in
                self.ref.named_parameters(remove_duplicate=False)}


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def agree(value: float, group: Any = None) -> bool:
    """Whether ``value`` is the same on every rank of ``group`` (the world by default)."""
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, value, group=group)
    return all(v == got[0] for v in got)


def on_rank(pp: int, dp: int, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the rank with these pipeline and data-parallel ranks only."""
    if smp.pp_rank() == pp and smp.dp_rank() == dp:
        fn()
