"""``smp.delay_param_initialization``: build a model too big for host memory on the meta device.

The construction is recorded (``init_tape``), so each stage is materialised on its rank
with the values an eager build with the same seed gives; a ``from_pretrained`` inside
reads each stage's weights from the files (``smp_fx.ckpt.pretrained``).
See docs/memory.md, 'Delayed parameter initialisation'.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from cost_model.errors import SMPRuntimeError
from smp_fx.marking.init_tape import Tape, recording, tape_of

DELAYED_ATTR = "_smp_delayed_init"
TAPE_ATTR = "_smp_init_tape"
"""Attribute of a module built in the context: the record that keeps its tensors
rebuildable (found again from each tensor's storage, ``init_tape.tape_of``)."""


@contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Create parameters and buffers on the meta device inside the block (if ``enabled``)."""
    if not enabled:
        yield
        return

    tape = Tape()

    def mark(mod: nn.Module, *_: object) -> None:
        object.__setattr__(mod, DELAYED_ATTR, True)
        object.__setattr__(mod, TAPE_ATTR, tape)

    from smp_fx.ckpt.pretrained import meta_from_pretrained

    handles = [
        module_mod.register_module_parameter_registration_hook(mark),
        module_mod.register_module_buffer_registration_hook(mark),
        module_mod.register_module_module_registration_hook(mark),
    ]
    try:
        with torch.device("meta"), meta_from_pretrained(), _hf_initialises_on_meta(), \
                recording(tape):
            yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _hf_initialises_on_meta() -> Iterator[None]:
    """transformers 5 skips ``_init_weights`` under a meta default device (nothing to fill):
    inside, it runs it, so the record holds the model's own initialisation."""
    if "transformers" not in sys.modules:
        yield
        return
    import transformers.modeling_utils as hf

    original = getattr(hf, "get_torch_context_manager_or_global_device", None)
    if original is None:  # transformers 4: initialises on meta already
        yield
        return

    def device() -> Any:
        found = original()
        return None if found == torch.device("meta") else found

    hf.get_torch_context_manager_or_global_device = device
    try:
        yield
    finally:
        hf.get_torch_context_manager_or_global_device = original


def extending(module: nn.Module, keeper: nn.Module | None = None) -> Any:
    """A context recording onto ``module``'s construction record (a dtype change or a
    replacement's weights taken on meta after the build), or nothing if it has none.
    ``keeper`` (``module``'s replacement) holds the record from then on, as the modules
    built in the context do, so the record outlives the replaced ``module``."""
    tape = next((t for t in map(tape_of, (*module.parameters(), *module.buffers()))
                 if t is not None), None)
    if tape is None:
        return nullcontext()
    if keeper is not None:
        object.__setattr__(keeper, TAPE_ATTR, tape)
    return recording(tape)


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
    """Give ``module``'s meta tensors on ``device`` their eager-build values, replayed from the
    record (a tensor-parallel shard as the slice of its source, one source at a time); ties
    stay. One that cannot be rebuilt is an ``SMPRuntimeError`` naming it."""
    slots = [(f"{path}.{name}" if path else name, m, table, name, value)
             for path, m in module.named_modules()
             for table in (m._parameters, m._buffers)
             for name, value in table.items() if value is not None]
    wanted: dict[Tape, dict[int, torch.Tensor]] = {}
    errors: list[str] = []
    for name, m, _, _, value in slots:
        if not value.is_meta:
            continue
        tape = tape_of(value)
        why = tape.problem(value) if tape is not None else "it was made outside " \
            "smp.delay_param_initialization"
        if why is None:
            wanted.setdefault(tape, {})[id(value)] = value  # type: ignore[arg-type]
        else:
            errors.append(f"{name} ({type(m).__name__}): {why}")
    if errors:
        raise SMPRuntimeError.build(
            "a delayed-init tensor must be rebuilt as the eager build makes it", errors[:5],
            "smp_fx.marking.delayed_init.materialize",
            "build the model inside smp.delay_param_initialization and fill every tensor "
            "in its constructor (or load a checkpoint into it)")
    values: dict[int, torch.Tensor] = {}
    for tape, tensors in wanted.items():
        whole = {k: t for k, t in tensors.items() if not tape.is_cut(t)}
        values.update(zip(whole, tape.replay(list(whole.values()))))
        for k, t in tensors.items():  # a shard: its full source alone, then dropped
            if k not in whole:
                values[k] = tape.replay([t])[0].clone()
    moved: dict[int, Any] = {}
    for _, _, table, leaf, value in slots:
        new = moved.get(id(value))
        if new is None:
            data = (values[id(value)] if value.is_meta else value.detach()).to(device)
            new = (nn.Parameter(data, requires_grad=value.requires_grad)
                   if isinstance(value, nn.Parameter) else data)
            moved[id(value)] = new
        table[leaf] = new
    object.__setattr__(module, DELAYED_ATTR, False)
    return module
