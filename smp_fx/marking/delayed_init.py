"""``smp.delay_param_initialization``: build a model too big for host memory on the meta device.

Inside the context every parameter and buffer created is a meta tensor (shape and dtype,
no storage), via ``torch.device("meta")`` as a default-device context. Every module that
registers a parameter, buffer or submodule inside the context is marked with the attribute
``_smp_delayed_init = True`` (an attribute only; ``forward`` is never touched), so
``DistributedModel`` knows to materialise the weights per stage, on the rank owning it,
with ``materialize(module, device)`` (``to_empty`` + ``reset_parameters``).

The compiler front end (``passes.trace`` / ``shape_prop`` / ``annotate_costs``) works on
such a model without allocating its weights.

A Hugging Face ``from_pretrained`` inside the context builds the model on meta too and
records its safetensors files; ``DistributedModel`` then allocates each stage without
initialising it (``allocate``) and each rank reads its own stage's weights from the files
(``smp_fx.ckpt.pretrained``).

Example::

    with smp.delay_param_initialization():
        model = GPT2XL()          # no weight memory
    assert is_delayed(model)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from cost_model.errors import SMPRuntimeError

DELAYED_ATTR = "_smp_delayed_init"


@contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Create parameters and buffers on the meta device inside the block (if ``enabled``)."""
    if not enabled:
        yield
        return

    def mark(mod: nn.Module, *_: object) -> None:
        object.__setattr__(mod, DELAYED_ATTR, True)

    from smp_fx.ckpt.pretrained import meta_from_pretrained

    handles = [
        module_mod.register_module_parameter_registration_hook(mark),
        module_mod.register_module_buffer_registration_hook(mark),
        module_mod.register_module_module_registration_hook(mark),
    ]
    try:
        with torch.device("meta"), meta_from_pretrained():
            yield
    finally:
        for h in handles:
            h.remove()


def is_delayed(module: nn.Module) -> bool:
    """True if ``module`` was built under ``delay_param_initialization`` or holds meta state."""
    if getattr(module, DELAYED_ATTR, False):
        return True
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def allocate(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Give ``module``'s meta parameters and buffers uninitialised memory on ``device`` and
    move the others there; tied parameters stay tied. For weights that are loaded next
    (``smp_fx.ckpt.pretrained``): nothing is initialised, and real buffers (a mask computed
    in ``__init__``) keep their values."""
    moved: dict[int, Any] = {}

    def place(value: torch.Tensor) -> torch.Tensor:
        new = moved.get(id(value))
        if new is None:
            data = (torch.empty_like(value, device=device) if value.is_meta
                    else value.detach().to(device))
            new = (nn.Parameter(data, requires_grad=value.requires_grad)
                   if isinstance(value, nn.Parameter) else data)
            moved[id(value)] = new
        return new

    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, value in list(table.items()):
                if value is not None:
                    table[name] = place(value)  # type: ignore[assignment]
    object.__setattr__(module, DELAYED_ATTR, False)
    return module


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate ``module``'s meta parameters on ``device`` and initialise them in place.

    Uses ``to_empty`` then each submodule's own ``reset_parameters`` (the initialisation
    its constructor would have done); tied parameters stay tied. A submodule holding meta
    parameters but no ``reset_parameters`` keeps uninitialised memory, so it is reported.
    """
    missing = [name for name, m in module.named_modules()
               if any(p.is_meta for p in m.parameters(recurse=False))
               and not hasattr(m, "reset_parameters")]
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((m, name))
    module.to_empty(device=device)
    for group in owners.values():  # to_empty replaces each alias separately: re-tie them
        first_mod, first_name = group[0]
        for m, name in group[1:]:
            setattr(m, name, getattr(first_mod, first_name))
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
    if missing:
        raise SMPRuntimeError.build(
            "delayed-init modules without reset_parameters() cannot be initialised",
            missing[:5], "smp_fx.marking.delayed_init.materialize",
            "add reset_parameters() to those modules or load a checkpoint into them")
    object.__setattr__(module, DELAYED_ATTR, False)
    return module
