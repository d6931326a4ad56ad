"""A script's own optimizer object under ``smp.DistributedOptimizer``.

AWS's SMP 1.6-1.9 examples (GPT-2, GPT-J, GPT-Neo, GPT-2-custom, in their fp16 runs) wrap
their own ``FP16_Optimizer`` (a Megatron-style plain object, not a
``torch.optim.Optimizer``) in ``smp.DistributedOptimizer`` and go on calling its methods
through the wrapper: ``backward(loss)``, ``update_master_grads()``,
``clip_master_grads(norm)``, ``zero_grad(set_grads_to_None=True)``, ``step()``, and
``init_master_params()`` from a post-step hook once the model is partitioned. Its
attributes (``overflow``, ``loss_scale``, ``fp16_groups``, ``fp32_from_fp16_groups``) are
read through the wrapper too.

So the wrapper accepts any object that holds a torch optimizer as ``.optimizer`` and gives
it ``param_groups`` (SMP's wrapped objects do). Narrowing the param groups to this rank's
parameters works on that torch optimizer, before the object makes its fp32 masters (it
makes them over the narrowed groups); checkpoints hold that torch optimizer's state by
parameter name, a master named as the model parameter behind it
(``fp32paramid_from_fp16paramid``, the object's own map). What the object does in its
methods (loss scaling, master weights, clipping) is its own, as under SMP.
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
