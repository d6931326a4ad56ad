"""The ``smddp`` torch.distributed backend, so SageMaker data-parallel scripts run unchanged:
an NCCL group with CUDA, gloo otherwise, destroyed at exit (such scripts never do).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from smp_fx.world import launch

NAME = "smddp"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def create_backend(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """Creator for ``register_backend``: NCCL on a CUDA machine, gloo elsewhere."""
    launch.destroy_at_exit()
    if _device() == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def register() -> None:
    """Make ``backend="smddp"`` valid in ``torch.distributed.init_process_group``."""
    if NAME.upper() in dist.Backend._plugins:  # already registered in this process
        return
    dist.Backend.register_backend(NAME, create_backend, devices=[_device()])


def is_registered() -> bool:
    return NAME.upper() in dist.Backend._plugins
