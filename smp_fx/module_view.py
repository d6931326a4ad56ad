"""``DistributedModel.module``: the layer SMP v1 put between the model and the user's module.

In SMP <= 1.9 ``smp.DistributedModel(m).module`` is a wrapper whose ``.module`` is ``m``;
with ``"fp16": true`` (SMP 1.10+) one more layer, ``FP16_Module``, sits on top. AWS's 1.x
scripts walk that chain to reach the layers they pin and checkpoint::

    m = model.module if args.fp16 else model
    transformer_layers = m.module.module.transformer.seq_layers

and 1.11+'s ``sharded_data_parallel_checkpoint.py`` names parameters through
``model.module.named_parameters()`` (``get_module()`` gives the user's module directly).

A ``ModuleView`` is that layer as a view, not a second module: ``.module`` is the object
below it, and every other attribute, call and method is the user's module's, so
``model.module.named_parameters()`` names parameters as ``model.named_parameters()`` does
(no ``module.`` prefix to strip; the 1.11+ script strips one only where it finds one) and
nothing is registered twice in the module tree.

>>> from torch import nn
>>> net = nn.Sequential(nn.Linear(2, 2))
>>> view = ModuleView(net, ModuleView(net, net, "wrapper"), "FP16_Module")
>>> view.module.module is net, view[0] is net[0], view._smp_layer
(True, True, 'FP16_Module')
"""

from __future__ import annotations

from typing import Any

from torch import nn


class ModuleView:
    """One layer of the chain above the user's module (see the module docstring)."""

    def __init__(self, target: nn.Module, below: Any, layer: str) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "module", below)
        object.__setattr__(self, "_smp_layer", layer)

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


def module_chain(module: nn.Module, fp16: bool) -> ModuleView:
    """What ``DistributedModel.module`` gives for ``module``: the wrapper whose ``.module``
    is ``module``, under SMP's ``FP16_Module`` layer when ``fp16`` is configured."""
    wrapper = ModuleView(module, module, "wrapper")
    return ModuleView(module, wrapper, "FP16_Module") if fp16 else wrapper


__all__ = ["ModuleView", "module_chain"]
