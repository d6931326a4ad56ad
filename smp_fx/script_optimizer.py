"""A script's own optimizer object under ``smp.DistributedOptimizer``.

AWS's SMP 1.6-1.9 examples wrap their own ``FP16_Optimizer`` (not a torch optimizer) and
call its methods through the wrapper; any object holding a torch optimizer as
``.optimizer`` is accepted, narrowed before it makes its masters. What its methods do is
its own, as under SMP. See docs/precision.md, 'fp16'.
"""

from __future__ import annotations

from typing import Any

import torch

from cost_model.errors import SMPRuntimeError


def is_script_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a script's own object rather than a torch optimizer."""
    return not isinstance(optimizer, torch.optim.Optimizer)


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose state is checkpointed: ``optimizer`` itself, or the one a
    script's object holds as ``.optimizer``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and hasattr(optimizer, "param_groups") \
            and callable(getattr(optimizer, "step", None)):
        return inner
    raise SMPRuntimeError.build(
        "DistributedOptimizer wraps a torch.optim.Optimizer, or an object holding one as "
        "'.optimizer' with 'param_groups' and 'step' (a script's FP16_Optimizer)",
        type(optimizer).__name__, "smp.DistributedOptimizer", "pass an optimizer instance")


def model_param_ids(optimizer: Any) -> dict[int, int]:
    """id(fp32 master) -> id(the model parameter it masters), from the object's own
    ``fp32paramid_from_fp16paramid`` (empty before it made masters, or for torch's)."""
    forward = getattr(optimizer, "fp32paramid_from_fp16paramid", None)
    if not isinstance(forward, dict):
        return {}
    return {master: model for model, master in forward.items()}


__all__ = ["is_script_optimizer", "model_param_ids", "torch_optimizer"]
