"""``smp.hvd_average_grads()``: average this rank's gradients over its data-parallel replicas.

SMP 1.x scripts written for Horovod-style data parallelism (``"horovod": true``, no DDP
wrapper) call it after the step, before ``optimizer.step()``, so that every replica steps
the same gradients. smp-fx averages the gradients of the process's ``DistributedModel``
(the parameters this rank holds) over the reduced data-parallel group (the ``RDP_GROUP``:
the replicas of the same pipeline stage and tp shard), summed then divided by its size,
as DDP's reducer averages. With ``ddp`` the step has already averaged them; averaging
equal gradients again leaves them as they are, so calling it there changes nothing.
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
