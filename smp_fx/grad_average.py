"""``smp.hvd_average_grads()``: average this rank's gradients over its rdp replicas, for SMP
1.x Horovod-style scripts; under ``ddp`` the gradients are equal already, so it changes
nothing.
"""

from __future__ import annotations

import torch.distributed as dist

from cost_model.errors import SMPRuntimeError
from smp_fx.model import DistributedModel
from smp_fx.world import comm
from smp_fx.world.context import current_model


def hvd_average_grads() -> None:
    """Average the current DistributedModel's local gradients over the rdp group. A
    collective over that group: every replica calls it."""
    model = current_model()
    if not isinstance(model, DistributedModel):
        raise SMPRuntimeError.build(
            "hvd_average_grads averages the gradients of the DistributedModel", None,
            "smp.hvd_average_grads()", "wrap the model in smp.DistributedModel and run a "
            "training step first")
    size = comm.rdp_size()
    if size == 1:
        return
    group = comm.get_rdp_process_group()
    for _, p in sorted(model.local_named_parameters(), key=lambda item: item[0]):
        if p.grad is not None:  # the same names in the same order on every replica
            dist.all_reduce(p.grad, group=group)
            p.grad /= size


__all__ = ["hvd_average_grads"]
