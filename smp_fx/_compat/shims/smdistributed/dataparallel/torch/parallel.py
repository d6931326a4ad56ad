"""The deprecated ``smdistributed.dataparallel.torch.parallel`` API: torch's own DDP."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
