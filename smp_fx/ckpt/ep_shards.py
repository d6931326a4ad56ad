"""Expert slices in checkpoints: gathered whole on save, each rank's rows cut on load.

At ``expert_parallel_degree`` > 1 an expert parameter (``...experts.gate_up_proj``) holds
E / ep experts on each rank of an ep group, under the plain model's name. A state dict
always holds every expert (``gather_full``, collective over the ep group), so files are
those of the plain model whatever the degree, and a load takes this rank's rows
(``expert_rows``). The optimizer's state of a slice (Adam's moments, an fp32 master: one
row per expert) is gathered and cut alike (``gather_optimizer_full``,
``optimizer_rows``). Under ZeRO-1 the ep ranks of a group own the same slices' state
(ownership is a function of the sizes), so each ep group gathers a slice's state whole or
holds none of it, and the rdp ranks' merge by name meets whole states only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

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
    for name in sorted(n for n in names if n in out):
        out[name] = _gathered(out[name])
    return out


def _gathered(piece: torch.Tensor) -> torch.Tensor:
    """Every ep rank's ``piece``, concatenated in ep rank order (collective over ep)."""
    group = expert_groups.get_ep_process_group()
    if piece.device.type == "cpu" and dist.get_backend(group) != "gloo":
        from smp_fx.world import state

        group = state.get().object_group("ep")
    pieces = [torch.empty_like(piece) for _ in range(expert_groups.ep_size())]
    dist.all_gather(pieces, piece.contiguous(), group=group)
    return torch.cat(pieces)


def gather_optimizer_full(local: Mapping[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """A partial optimizer state (by FQN) with each expert slice's state tensors, one row
    per local expert, replaced by every expert's (collective over the ep group, whose ranks
    hold the same names: one stage, one tp shard)."""
    out = dict(local)
    if not names or expert_groups.ep_size() == 1:
        return out
    state = dict(out["state"])
    for name in sorted(n for n in names if n in state):
        state[name] = {k: _gathered(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                       for k, v in state[name].items()}
    out["state"] = state
    return out


def optimizer_rows(state: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]
                   ) -> dict[str, Any]:
    """Optimizer state entries by FQN with each expert slice's tensors (named in
    ``shapes``, by the local parameter's shape) cut to this ep rank's experts."""
    return {n: {k: expert_rows(v, shapes[n]) if isinstance(v, torch.Tensor) and v.dim() > 0
                else v for k, v in entry.items()} if n in shapes else entry
            for n, entry in state.items()}


def expert_rows(full: torch.Tensor, local_shape: tuple[int, ...]) -> torch.Tensor:
    """This ep rank's experts of a tensor holding every expert (one already cut, of
    ``local_shape``, is returned as it is; the shape check after it tells the rest)."""
    if tuple(full.shape) == local_shape or full.shape[0] != local_shape[0] * \
            expert_groups.ep_size():
        return full
    return full.chunk(expert_groups.ep_size())[expert_groups.ep_rank()]
