"""The deprecated ``smdistributed.dataparallel.torch.parallel`` API: torch's own DDP, with
the smddp guide's argument order (torch's puts ``dim`` third)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel(module, device_ids, output_device,
    broadcast_buffers, process_group, bucket_cap_mb)`` in that positional order; any other
    torch DDP option may be given by keyword."""

    def __init__(self, module: nn.Module, device_ids: Any = None, output_device: Any = None,
                 broadcast_buffers: bool = True, process_group: Any = None,
                 bucket_cap_mb: float | None = None, **kwargs: Any) -> None:
        if not broadcast_buffers:  # True is torch's default, which newer torch asks not to pass
            kwargs["broadcast_buffers"] = False
        super().__init__(module, device_ids=device_ids, output_device=output_device,
                         process_group=process_group, bucket_cap_mb=bucket_cap_mb, **kwargs)
