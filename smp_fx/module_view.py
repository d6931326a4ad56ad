"""``DistributedModel.module``: the layer SMP v1 put between the model and the user's module.

AWS's 1.x scripts walk ``model.module.module...`` to reach their layers; a ``ModuleView``
is that layer as a view, not a second module: attributes are the user's module's, the
parameter walks the ``DistributedModel``'s, as in SMP. See docs/clients.md.

>>> from torch import nn
>>> net = nn.Sequential(nn.Linear(2, 2))
>>> view = ModuleView(net, ModuleView(net, net, "wrapper", net), "FP16_Module", net)
>>> view.module.module is net, view[0] is net[0], view._smp_layer
(True, True, 'FP16_Module')
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn


class ModuleView:
    """One layer of the chain above the user's module (see the module docstring)."""

    _owner: nn.Module

    def __init__(self, target: nn.Module, below: Any, layer: str, owner: nn.Module) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "module", below)
        object.__setattr__(self, "_smp_layer", layer)
        object.__setattr__(self, "_owner", owner)  # whose walks reach the trained tensors

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self._owner.named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._owner.parameters(recurse)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._owner.zero_grad(set_to_none)

    def requires_grad_(self, requires_grad: bool = True) -> ModuleView:
        self._owner.requires_grad_(requires_grad)
        return self

    def train(self, mode: bool = True) -> ModuleView:
        self._owner.train(mode)
        return self

    def eval(self) -> ModuleView:
        return self.train(False)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_target"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_target"), name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return object.__getattribute__(self, "_target")(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        return object.__getattribute__(self, "_target")[key]

    def __iter__(self) -> Any:
        return iter(object.__getattribute__(self, "_target"))

    def __len__(self) -> int:
        return len(object.__getattribute__(self, "_target"))

    def __repr__(self) -> str:
        return f"ModuleView[{self._smp_layer}]({object.__getattribute__(self, '_target')!r})"


def module_chain(module: nn.Module, fp16: bool, owner: nn.Module) -> ModuleView:
    """What ``DistributedModel.module`` (``owner``) gives for ``module``: the wrapper whose
    ``.module`` is ``module``, under SMP's ``FP16_Module`` layer when ``fp16`` is
    configured."""
    wrapper = ModuleView(module, module, "wrapper", owner)
    return ModuleView(module, wrapper, "FP16_Module", owner) if fp16 else wrapper


__all__ = ["ModuleView", "module_chain"]
