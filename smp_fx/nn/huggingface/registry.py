"""The Hugging Face models SMP replaces by its distributed modules, one entry per class.

Classes are named by import path so nothing of transformers is imported to find them; a
user's ``smp.tp_register`` of the same class wins. ``rebuild`` carries the original's
weights (strictly translated), dtype, device and mode; a meta original gives a meta
replacement materialised per stage. See docs/tensor_parallel.md.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from cost_model.errors import SMPConfigError
from smp_fx.marking import tp_register
from smp_fx.marking.delayed_init import DELAYED_ATTR, extending
from smp_fx.nn.transformer import DistributedTransformerLMHead
from smp_fx.world.state_api import Translator, module_manager

log = logging.getLogger("smp_fx.replacements")
Builder = Callable[[nn.Module, dict[str, Any]], nn.Module]


@dataclass(frozen=True)
class Replacement:
    """``hf_class`` (``module.QualName``) -> ``build(instance, overrides)``; the pair is
    ``(smp_to_hf, hf_to_smp)``; ``bound(config)``, where translating needs the config (GPT-
    NeoX's head count), the pair ``smp.state.module_manager`` gets instead."""

    hf_class: str
    build: Builder
    translate_functions: tuple[Translator, Translator]
    bound: Callable[[Any], tuple[Translator, Translator]] | None = None


REPLACEMENTS: dict[str, Replacement] = {}


def register(entry: Replacement) -> None:
    """Make ``entry`` one of the replacements ``smp.DistributedModel`` applies."""
    REPLACEMENTS[entry.hf_class] = entry

    def build(original: nn.Module, overrides: dict[str, Any]) -> nn.Module:
        new = entry.build(original, overrides)
        pair = entry.translate_functions if entry.bound is None else \
            entry.bound(getattr(original, "config", None))
        if pair not in module_manager.translate_functions:
            module_manager.register_translate_function(pair)
        return new

    tp_register.register_predefined(entry.hf_class, build)


def register_lm(hf_class: str, cls: Callable[..., nn.Module],
                translate_functions: tuple[Translator, Translator],
                bound: Callable[[Any], tuple[Translator, Translator]] | None = None) -> None:
    """Register a family whose replacement is ``cls(config, **overrides)``, a
    ``DistributedTransformerLMHead`` taking the original's weights by the family's
    ``hf_to_smp`` (bound to the original's config when ``bound`` is given)."""
    def build(original: nn.Module, overrides: dict[str, Any]) -> nn.Module:
        config = getattr(original, "config", None)
        hf_to_smp = (translate_functions if bound is None else bound(config))[1]
        kwargs = init_overrides(DistributedTransformerLMHead, overrides)
        return rebuild(original, cls(config, **kwargs), hf_to_smp)

    register(Replacement(hf_class, build, translate_functions, bound))


def hf_state(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``state`` in ``model``'s Hugging Face names: translated by the replacement of
    ``model``'s class when ``state`` came from SMP's distributed version of it (a partial
    checkpoint of a replaced model, exported by a process that never replaced one), or of
    one of its submodules (BERT's encoder)."""
    if not set(state) - set(model.state_dict()):
        return state
    for module in model.modules():
        cls = type(module)
        entry = REPLACEMENTS.get(f"{cls.__module__}.{cls.__qualname__}")
        if entry is not None:
            return entry.translate_functions[0](state)
    return state


def init_overrides(cls: type[nn.Module], overrides: dict[str, Any]) -> dict[str, Any]:
    """The keywords of ``smp.tensor_parallelism(**kwargs)`` / ``smp.model_creation`` that
    are arguments of ``cls``: they override the values taken from the config (SMP's rule);
    the others concern SMP's kernels (``smp_fx.marking.model_creation`` checks them)."""
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in overrides.items() if k in params and k != "self"}


REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""An original's parameter -> the parameters of its replacement that took its values (one,
or the parts of a fused tensor), for an optimizer made on the original's parameters."""


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _record_replaced(original: nn.Module, new: nn.Module,
                     translated: dict[str, Any]) -> None:
    """Fill ``REPLACED`` for ``original``: the translated tensors are views of the
    original's (module ``translate``), so each new parameter's source is found by storage."""
    sources = {_storage(p): p for p in original.parameters()}
    params = dict(new.named_parameters())
    for name, t in translated.items():
        src, q = sources.get(_storage(t)), params.get(name)
        if src is not None and q is not None and all(q is not k for k in
                                                     REPLACED.get(src, [])):
            REPLACED.setdefault(src, []).append(q)


def follow_replacements(optimizer: torch.optim.Optimizer) -> bool:
    """Put in ``optimizer``'s groups, for each parameter of a replaced original, the
    replacement's parameters that took its values (in that parameter's group, so its
    options hold); whether anything changed. State already held for an original is
    dropped, with a warning (the replacement's parameters start without it)."""
    changed = False
    for group in optimizer.param_groups:
        kept: list[torch.Tensor] = []
        for p in group["params"]:
            for q in REPLACED.get(p, [p]):
                if all(q is not k for k in kept):
                    kept.append(q)
            if p in REPLACED:
                changed = True
                if optimizer.state.pop(p, None):
                    log.warning("optimizer state of a replaced parameter %s dropped: its "
                                "replacement starts without it", tuple(p.shape))
        group["params"] = kept
    return changed


def _to_meta(module: nn.Module) -> None:
    """``module`` on meta, ties kept: parameters empty (the translation fills them),
    buffers with their values (computed in ``__init__``, recorded as constants)."""
    made: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                           p.requires_grad)
            setattr(m, name, made[id(p)])
        for name, b in list(m.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(m, name, b.to("meta"))  # a buffer stays one, persistent or not


def rebuild(original: nn.Module, new: nn.Module,
            hf_to_smp: Callable[[dict[str, Any]], dict[str, Any]]) -> nn.Module:
    """``new`` with ``original``'s weights (translated), dtype, device and mode."""
    tensors = [*original.parameters(), *original.buffers()]
    floats = [t for t in tensors if t.is_floating_point()]
    dtype = floats[0].dtype if floats else torch.get_default_dtype()
    device = tensors[0].device if tensors else torch.device("cpu")
    new.to(dtype=dtype)
    new.train(original.training)
    if device.type == "meta":  # recorded (copies the translation makes too), so
        with extending(original, new):  # materialising gives the translated weights
            translated = hf_to_smp(original.state_dict())
            _to_meta(new)
            missing, unexpected = new.load_state_dict(translated, strict=False)
        object.__setattr__(new, DELAYED_ATTR, True)
    else:
        translated = hf_to_smp(original.state_dict())
        missing, unexpected = new.load_state_dict(translated, strict=False)
    _record_replaced(original, new, translated)
    tied = {n for n, p in new.named_parameters(remove_duplicate=False)} - \
        {n for n, p in new.named_parameters()}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise SMPConfigError.build(
            f"{type(original).__name__}'s weights do not fill its distributed version",
            {"missing": missing[:5], "unexpected": unexpected[:5]},
            f"replacing {type(original).__name__}",
            "build the model from its config unchanged (a modified architecture is not "
            "the one SMP distributes), or create it outside tensor parallelism")
    return new.to(device)


__all__ = ["REPLACED", "Replacement", "follow_replacements", "rebuild", "register",
           "register_lm"]
