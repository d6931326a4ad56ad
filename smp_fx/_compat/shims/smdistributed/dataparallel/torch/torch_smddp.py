"""``import smdistributed.dataparallel.torch.torch_smddp`` registers the ``smddp`` backend:
``torch.distributed.init_process_group(backend="smddp")`` then runs on NCCL (GPU) or gloo."""

from __future__ import annotations

from smp_fx.world.smddp import register

register()
