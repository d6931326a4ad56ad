"""SMP's activation-checkpointing API: ``smp.set_activation_checkpointing``,
``smp.checkpoint`` and ``smp.checkpoint_sequential``.

Each marks a module, turned into checkpointed regions at partitioning. Called inside a
forward while smp-fx traces, ``smp.checkpoint`` marks and calls plainly; anywhere else it
runs ``torch.utils.checkpoint``, so the same model code works without smp.
See docs/memory.md, 'Marking modules'.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from cost_model.errors import SMPConfigError
from passes.partition_config import ATTENTION_CORE, CheckpointRule
from smp_fx.world import context


@dataclass(frozen=True)
class _Mark:
    preserve_rng_state: bool
    pack_args_as_tuple: bool
    strategy: str
    whole: bool = False  # smp.checkpoint: the module is one region, even a Sequential


_marks: weakref.WeakKeyDictionary[nn.Module, _Mark] = weakref.WeakKeyDictionary()


def _unwrap(module: nn.Module) -> nn.Module:
    get = getattr(module, "get_module", None)  # a DistributedModel: its wrapped module
    inner = get() if callable(get) else None
    return inner if isinstance(inner, nn.Module) else module


def set_activation_checkpointing(module: nn.Module, preserve_rng_state: bool = True,
                                 pack_args_as_tuple: bool = False,
                                 strategy: str = "each") -> None:
    """Run ``module`` under activation checkpointing (SMP's signature), before the first
    ``smp.step``; strategies as docs/memory.md, 'Marking modules', lists them."""
    if not isinstance(module, nn.Module):
        raise SMPConfigError.build("set_activation_checkpointing takes an nn.Module",
                                   type(module).__name__, "smp.set_activation_checkpointing",
                                   "pass a submodule of the model")
    CheckpointRule("", strategy)  # validates the strategy's spelling
    if strategy not in ("each", ATTENTION_CORE) and not isinstance(module, nn.Sequential):
        raise SMPConfigError.build(
            "strategy applies to an nn.Sequential only", f"{strategy!r} on "
            f"{type(module).__name__}", "smp.set_activation_checkpointing",
            "use strategy='each' (the module is one region)")
    model = context.current_model()
    if model is not None and model.partitioned and any(
            m is module for m in model.get_module().modules()):
        raise SMPConfigError.build(
            "activation checkpointing is set before the model is partitioned",
            type(module).__name__, "smp.set_activation_checkpointing",
            "call it before the first smp.step")
    _marks[module] = _Mark(bool(preserve_rng_state), bool(pack_args_as_tuple), strategy)


def is_marked(module: nn.Module) -> bool:
    """Whether ``module`` is marked for activation checkpointing."""
    return module in _marks


def checkpoint(module: nn.Module, *args: Any, preserve_rng_state: bool = True) -> Any:
    """``module(*args)`` with its activations recomputed in backward (SMP's
    ``smp.checkpoint``); see the module docstring."""
    if context.is_tracing():
        _marks[module] = _Mark(bool(preserve_rng_state), False, "each", whole=True)
        return module(*args)
    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False,
                                             preserve_rng_state=preserve_rng_state)


def checkpoint_sequential(sequential_module: nn.Sequential, input: Any,
                          strategy: str = "each", preserve_rng_state: bool = True,
                          pack_args_as_tuple: bool = False) -> Any:
    """``sequential_module(input)`` with its children checkpointed by ``strategy`` (SMP's
    ``smp.checkpoint_sequential``); see ``set_activation_checkpointing``."""
    if not isinstance(sequential_module, nn.Sequential):
        raise SMPConfigError.build("checkpoint_sequential takes an nn.Sequential",
                                   type(sequential_module).__name__,
                                   "smp.checkpoint_sequential", "use smp.checkpoint")
    rule = CheckpointRule("", strategy, preserve_rng_state)
    if strategy == ATTENTION_CORE:
        raise SMPConfigError.build(
            "checkpoint_sequential groups children; 'attention_core' is a strategy of "
            "smp.set_activation_checkpointing", strategy, "smp.checkpoint_sequential",
            "call smp.set_activation_checkpointing(module, strategy='attention_core')")
    if context.is_tracing():
        _marks[sequential_module] = _Mark(bool(preserve_rng_state), bool(pack_args_as_tuple),
                                          strategy)
        return sequential_module(input)
    children = list(sequential_module)
    size = rule.group_size or len(children)  # outside a pipeline one stage holds them all
    value = input
    for lo in range(0, len(children), size):
        group = nn.Sequential(*children[lo:lo + size])
        args = (value,) if pack_args_as_tuple or not isinstance(value, tuple) else value
        value = torch.utils.checkpoint.checkpoint(
            _run_group(group, pack_args_as_tuple), *args, use_reentrant=False,
            preserve_rng_state=preserve_rng_state)
    return value


def _run_group(group: nn.Sequential, packed: bool) -> Any:
    def run(*args: Any) -> Any:
        value: Any = args[0] if packed or len(args) == 1 else args
        for child in group:
            value = child(value) if packed or not isinstance(value, tuple) else child(*value)
        return value

    return run


def checkpoint_rules(model: nn.Module) -> tuple[CheckpointRule, ...]:
    """The marked modules of ``model`` as compiler rules (by module path, in model order)."""
    out = []
    for path, mod in _unwrap(model).named_modules():
        mark = _marks.get(mod)
        if mark is not None:
            out.append(_rule(path, mod, mark.strategy, mark.preserve_rng_state, mark.whole))
    return tuple(out)


def rules_from_patterns(model: nn.Module, patterns: Sequence[str]
                        ) -> tuple[CheckpointRule, ...]:
    """Rules for ``smp-fx partition --activation-checkpointing GLOB[:STRATEGY]``: every
    module whose path matches the glob (``h.*``, ``blocks``; ``''`` is the root), the
    strategy applying to the matched ``nn.Sequential``s (default ``each``;
    ``attention_core`` to any module)."""
    out: list[CheckpointRule] = []
    for pattern in patterns:
        glob, _, strategy = pattern.partition(":")
        found = [(p, m) for p, m in model.named_modules() if fnmatch.fnmatchcase(p, glob)]
        if not found:
            raise SMPConfigError.build("no module path matches the pattern", glob,
                                       "--activation-checkpointing",
                                       "use a module path or a glob such as 'h.*'")
        for path, mod in found:
            if strategy not in ("", "each", ATTENTION_CORE) and not isinstance(
                    mod, nn.Sequential):
                raise SMPConfigError.build(
                    "strategy applies to an nn.Sequential only", f"{path!r}:{strategy}",
                    "--activation-checkpointing", "drop the strategy for this pattern")
            out.append(_rule(path, mod, strategy or "each", True, False))
    return tuple(out)


def _rule(path: str, mod: nn.Module, strategy: str, preserve_rng_state: bool,
          whole: bool) -> CheckpointRule:
    children: Sequence[str] = ()
    if isinstance(mod, nn.Sequential) and not whole and strategy != ATTENTION_CORE:
        children = tuple(name for name, _ in mod.named_children())
    return CheckpointRule(path, strategy, preserve_rng_state, tuple(children))


def clear(model: nn.Module) -> None:
    """Forget every mark on ``model``'s modules (tests build several models in one run)."""
    for _, mod in _unwrap(model).named_modules():
        _marks.pop(mod, None)
