"""``smp.DistributedOptimizer``: any torch optimizer, stepping only this rank's parameters.

The wrapped optimizer is built over the full model's parameters before partitioning (from
the unwrapped model or from ``DistributedModel.parameters()``). At partitioning its param
groups are narrowed, in place, to the parameters of this rank's stages (hyper-parameters
kept); a parameter is found by its fully qualified name, so parameters that materialisation
re-created (delayed initialisation) are mapped too. ``global_index`` keeps, for each local
parameter, its index in the optimizer's original flat parameter order: the seam for
checkpointing, which will gather and merge optimizer state by that index.

It is a ``torch.optim.Optimizer`` (LR schedulers accept it); attributes it does not define
are the wrapped optimizer's. An optimizer built before its ``DistributedModel`` (the
Hugging Face Trainer builds the optimizer, then wraps the model) is adopted by the model
when the model is created.

>>> import torch
>>> opt = DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
>>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
>>> opt.step(); sched.step(); opt.param_groups[0]["lr"]
0.05
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from cost_model.errors import SMPRuntimeError
from smp_fx.ckpt import checkpoint_api
from smp_fx.ckpt.mixins import OptimizerCheckpointMixin
from smp_fx.dist import state
from smp_fx.dist.ddp import guard_optimizer
from smp_fx.runtime import context
from smp_fx.runtime.context import current_model


class DistributedOptimizer(OptimizerCheckpointMixin, torch.optim.Optimizer):
    """See the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: D107
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SMPRuntimeError.build("DistributedOptimizer wraps a torch.optim.Optimizer",
                                        type(optimizer).__name__, "smp.DistributedOptimizer",
                                        "pass an optimizer instance")
        if state.is_initialized():  # shard_optimizer_state & co: an error, never ignored
            state.get().config.check_features("DistributedOptimizer")
        self.optimizer = optimizer
        guard_optimizer(optimizer)  # optimizer.step() inside smp.step raises (smp_fx.dist.ddp)
        self._optimizer_step_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._zero_grad_profile_name = "Optimizer.zero_grad"
        flat = [p for g in optimizer.param_groups for p in g["params"]]
        self.global_index: dict[int, int] = {id(p): i for i, p in enumerate(flat)}
        self._localized = False
        self._names: dict[int, str] = {}
        context.set_current_optimizer(self)
        model = current_model()
        if model is not None and model.owns_parameters(flat):
            self.join_model(model)
        else:  # a DistributedModel created later adopts it; over other parameters: left whole
            context.wait_for_model(self)

    # accelerate (the Hugging Face Trainer's Accelerator.prepare) wraps every optimizer it
    # is given unless it says it was prepared already. This one steps exactly this rank's
    # stage parameters, outside smp.step, and needs none of AcceleratedOptimizer's device
    # placement or loss scaling; wrapped, the Trainer's SMP checkpointing could not reach
    # local_state_dict.
    _is_accelerate_prepared = True

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step()`` skipped the update (what accelerate asks of its
        optimizers). Only loss scaling skips steps, and smp-fx has none (``fp16`` is not
        implemented), so never."""
        return False

    def parameters_held(self) -> list[torch.Tensor]:
        """Every parameter of the wrapped optimizer, in group order."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def join_model(self, model: Any) -> None:
        """Belong to ``model`` (a DistributedModel holding this optimizer's parameters):
        parameters are named by its module's names and narrowed at its partitioning."""
        context.stop_waiting(self)
        self._names = {id(p): n for n, p in model.module.named_parameters()}
        self._smp_name_parameters(model)
        model.attach_optimizer(self)
        checkpoint_api.adopt_pending(optimizer=self)

    # the wrapped optimizer's containers are this optimizer's
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def _localize(self, model: Any) -> None:
        """Keep only this rank's parameters, matched by identity, then by name."""
        if self._localized:
            return
        local = dict(model.local_named_parameters())
        local_ids = {id(p): p for p in local.values()}
        # A local parameter's name may be any alias of a tied one (lm_head.weight for
        # wte.weight): go through the original object to the optimizer's canonical name.
        canon = getattr(model, "canonical_names", {})
        by_name = {canon.get(n, n): q for n, q in local.items()}
        index: dict[int, int] = {}
        for group in self.optimizer.param_groups:
            kept: list[torch.Tensor] = []
            for p in group["params"]:
                q = local_ids.get(id(p))
                if q is None:
                    q = by_name.get(self._names.get(id(p), ""))
                if q is not None and all(q is not k for k in kept):
                    kept.append(q)
                    index[id(q)] = self.global_index[id(p)]
            group["params"] = kept
        self.global_index = index
        self._localized = True
