"""What a step function needs when the model's outputs stay each cp rank's tokens.

Under ``context_parallel_local_outputs`` the logits are not gathered: each cp rank gets
the rows of its own tokens (chunks r and 2cp - 1 - r of the sequence, in that order).
``cp_positions`` names those tokens' global positions (to pick their targets), and
``cp_mean`` turns per-rank sums into one process's mean, so the loss and its gradients
equal the unsplit model's (docs/context_parallel.md).
"""

from __future__ import annotations

import torch

from cost_model.errors import SMPRuntimeError
from passes.context_parallel import collectives
from smp_fx.world import state


def cp_positions(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions, among ``length``, of the tokens this cp rank's outputs hold, in
    their order (all of them at cp 1): ``targets[:, smp.cp_positions(S)]``."""
    st = state.get()
    size, rank = st.axis_size("cp"), st.axis_rank("cp")
    if size == 1:
        return torch.arange(length, device=device)
    return collectives.local_index(length, size, rank, torch.device(device or "cpu"))


def cp_mean(total: torch.Tensor, count: torch.Tensor | int | float) -> torch.Tensor:
    """``total`` summed over the cp group over ``count`` summed over it: the mean over every
    rank's tokens of a per-token loss whose sum over this rank's tokens is ``total`` and
    counts ``count`` of them. Its gradient reaches each rank's own tokens."""
    if state.get().axis_size("cp") == 1:
        return total / count
    if not collectives.active():
        raise SMPRuntimeError.build(
            "cp_mean sums over the context-parallel group, which is bound when the "
            "DistributedModel first runs", "cp_mean", "smp.cp_mean",
            "call it inside an smp.step function, after the model's forward")
    counts = torch.as_tensor(count, dtype=total.dtype, device=total.device)
    return collectives.cp_sum(total) / collectives.cp_sum(counts.detach())


__all__ = ["cp_mean", "cp_positions"]
