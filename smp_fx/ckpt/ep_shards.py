"""Expert slices in checkpoints: gathered whole on save, each rank's rows cut on load.

At ``expert_parallel_degree`` > 1 an expert parameter (``...experts.gate_up_proj``) holds
E / ep experts on each rank of an ep group, under the plain model's name. A state dict
always holds every expert (``gather_full``, collective over the ep group), so files are
those of the plain model whatever the degree, and a load takes this rank's rows
(``expert_rows``). The optimizer's state of the slices is not gathered yet: its
checkpoints are refused at ep > 1 (``refuse_optimizer_state``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPNotImplementedError
from smp_fx.world import expert_groups


def gather_full(local: Mapping[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """``local`` with each expert slice replaced by every expert (concatenated in ep rank
    order over the ep group; collective over it)."""
    out = dict(local)
    if not names:  # no experts: nothing to gather (also before smp.init)
        return out
    ep = expert_groups.ep_size()
    if ep == 1:
        return out
    group = expert_groups.get_ep_process_group()
    for name in sorted(n for n in names if n in out):
        piece: torch.Tensor = out[name]
        pieces = [torch.empty_like(piece) for _ in range(ep)]
        dist.all_gather(pieces, piece.contiguous(), group=group)
        out[name] = torch.cat(pieces)
    return out


def expert_rows(full: torch.Tensor, local_shape: tuple[int, ...]) -> torch.Tensor:
    """This ep rank's experts of a tensor holding every expert (one already cut, of
    ``local_shape``, is returned as it is; the shape check after it tells the rest)."""
    if tuple(full.shape) == local_shape or full.shape[0] != local_shape[0] * \
            expert_groups.ep_size():
        return full
    return full.chunk(expert_groups.ep_size())[expert_groups.ep_rank()]


def refuse_optimizer_state(model: Any, method: str) -> None:
    """Optimizer checkpoints hold the state of expert slices per ep rank, which the
    optimizer's state files do not yet gather: refused, not saved half."""
    if model is not None and getattr(model, "expert_names", None) and \
            expert_groups.ep_size() > 1:
        raise SMPNotImplementedError.build(
            "optimizer state checkpoints at expert_parallel_degree > 1", method,
            "DistributedOptimizer", "save the model's state_dict() (experts gathered); "
            "optimizer state with split experts is not built yet")
