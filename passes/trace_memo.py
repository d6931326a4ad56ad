"""torch.export's program reused for a model of the same structure at the same inputs.

Why: a process that builds the same model again (a notebook cell building a Hugging Face
model run twice, a grid of configurations in one world, a model rebuilt after
``smp.reset()``) would pay torch.export again: 0.6-1.9 CPU-s for a tiny Hugging Face model
(``benchmarks/trace_memo.py``), far more for a large one, against 0.03-0.14 to reuse it.
What export produces depends on the model's code (its classes and functions as objects:
one redefined is another), its modules' attributes, its parameters' and buffers' shapes,
dtypes, devices and ties, the inputs' shapes and the autograd / autocast state, not on
any weight's value. ``model_key`` is all of that, or a reason why a model has no key (a
hook, a closure, an attribute of a type it cannot read, a class defined in ``__main__``);
``recall`` hands back the remembered program with the new model's own parameters, buffers
and tensor attributes in it, so the graph smp-fx builds from it reads the new model, never
the one first exported. The programs kept hold no weights (fake tensors only), at most
``CAPACITY`` of them, the most recently used. ``SMP_FX_TRACE_MEMO=0`` turns it off.
"""

from __future__ import annotations

import copy
import enum
import functools
import logging
import os
import types
from collections import Counter, OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from passes.graph_utils import tensor_at

log = logging.getLogger("smp_fx.passes.trace")

CAPACITY = 8
"""Programs remembered per process."""
ENV = "SMP_FX_TRACE_MEMO"
MAX_TENSOR_ATTR = 4096
"""A plain tensor attribute (not a parameter or buffer) is keyed by its values up to this
many elements (export may read them); a larger one gives the model no key."""
MAX_DEPTH = 6
NOT_TRACED = "__smp_not_traced__"
"""A class attribute: true on a class whose instances a forward never reads (smp-fx's
delayed-initialisation tape on a model built under it, which records how the weights
were made); such an attribute is keyed by its class alone, not its contents (a random
generator's state, every recorded op)."""
PROCESS_HASHES = frozenset({"_original_object_hash"})
"""Object attributes left out of the key: Python's hash of the object's own other
attributes (transformers' ``GenerationConfig`` keeps one), which string hashing makes
differ between processes while the attributes it hashes are keyed themselves."""

_MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
    "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook", "_forward_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"})
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_TORCH_VALUES = (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)


class Unkeyable(Exception):
    """The model or its inputs hold something whose effect on the trace cannot be read."""


@dataclass
class MemoStats:
    """What the memo did in this process: programs reused, exports remembered, and why
    models had no key (a model without one is exported as before)."""

    hits: int = 0
    stored: int = 0
    unkeyed: Counter[str] = field(default_factory=Counter)


STATS = MemoStats()
_PROGRAMS: OrderedDict[Hashable, Any] = OrderedDict()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def clear() -> None:
    """Forget every remembered program and the counts."""
    _PROGRAMS.clear()
    STATS.hits = STATS.stored = 0
    STATS.unkeyed.clear()


def _name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _code(obj: type | types.FunctionType, where: str) -> Hashable:
    """A class or function as itself (its identity: one redefined or reloaded is another
    object); one defined in ``__main__`` (a script's or a notebook's, whose cells can
    redefine what it calls without redefining it) gives no key."""
    if getattr(obj, "__module__", None) == "__main__":
        raise Unkeyable(f"{where}: {obj.__qualname__} is defined in __main__, where what it "
                        "calls can be redefined without it")
    return obj


def _state_in_dict(cls: type) -> bool:
    """Whether an instance's state is its ``__dict__``: a class defined in Python (a heap
    type) without ``__slots__``; not a bound method, a C type or a module, whose state
    lives elsewhere."""
    heap = bool(cls.__flags__ & (1 << 9))  # Py_TPFLAGS_HEAPTYPE
    return heap and not issubclass(cls, (types.ModuleType, types.MethodType)) and not any(
        "__slots__" in vars(c) for c in cls.__mro__ if c is not object)


class _Keyer:
    """Turns values into hashable keys; an object met twice is keyed once (and kept
    alive meanwhile, so no later object can take its id)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[Any, Hashable]] = {}

    def value(self, v: Any, where: str, depth: int = 0) -> Hashable:
        if isinstance(v, _PLAIN):
            return (type(v).__name__, v)
        if isinstance(v, _TORCH_VALUES):
            return ("torch", str(v))
        if isinstance(v, enum.Enum):
            return (_name(type(v)), v.name)
        if depth > MAX_DEPTH:
            raise Unkeyable(f"{where} nests deeper than {MAX_DEPTH}")
        if id(v) in self.seen:
            return self.seen[id(v)][1]
        key = self._compound(v, where, depth)
        self.seen[id(v)] = (v, key)
        return key

    def _compound(self, v: Any, where: str, depth: int) -> Hashable:
        if isinstance(v, torch.Tensor):
            return self.tensor_attr(v, where)
        if isinstance(v, (tuple, list)):
            return (type(v).__name__,
                    tuple(self.value(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)))
        if isinstance(v, (set, frozenset)):
            return (type(v).__name__, tuple(sorted(repr(self.value(x, where, depth + 1))
                                                   for x in v)))
        if isinstance(v, Mapping):
            return (_name(type(v)), tuple(sorted(
                ((repr(self.value(k, where, depth + 1)), self.value(x, f"{where}[{k!r}]",
                                                                    depth + 1))
                 for k, x in v.items()), key=lambda kv: kv[0])))
        if isinstance(v, type):
            return ("type", _code(v, where))
        if isinstance(v, types.FunctionType):
            if v.__closure__:
                raise Unkeyable(f"{where} is a closure ({_name(v)})")
            return ("function", _code(v, where))
        if isinstance(v, types.BuiltinFunctionType):
            if not isinstance(getattr(v, "__self__", None), (type(None), types.ModuleType, type)):
                raise Unkeyable(f"{where} is a method bound to a {type(v.__self__).__name__}")
            return ("builtin", v)
        if isinstance(v, functools.partial):
            return ("partial", self.value(v.func, where, depth + 1),
                    self.value(v.args, where, depth + 1), self.value(v.keywords, where, depth + 1))
        if isinstance(v, nn.Module):
            raise Unkeyable(f"{where} holds a module outside the module tree")
        if getattr(type(v), NOT_TRACED, False):
            return ("not traced", _name(type(v)))
        if _state_in_dict(type(v)):
            state = {a: x for a, x in vars(v).items() if a not in PROCESS_HASHES}
            return (_code(type(v), where), self.value(state, where, depth + 1))
        raise Unkeyable(f"{where} is a {type(v).__name__}, which the key cannot read")

    def tensor_attr(self, t: torch.Tensor, where: str) -> Hashable:
        if t.numel() > MAX_TENSOR_ATTR:
            raise Unkeyable(f"{where} is a tensor attribute of {t.numel()} elements "
                            f"(more than {MAX_TENSOR_ATTR})")
        values = () if t.is_meta else tuple(t.detach().cpu().flatten().tolist())
        return ("tensor", tuple(t.shape), str(t.dtype), t.device.type, values)


def _leaf(k: _Keyer, x: Any, where: str) -> Hashable:
    if isinstance(x, torch.Tensor):
        return ("input", tuple(x.shape), str(x.dtype), x.device.type, x.requires_grad,
                x.layout, x.is_contiguous())
    return k.value(x, where)


def _global_state() -> Hashable:
    autocast = tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d)))
                     for d in ("cpu", "cuda"))
    hooks = nn.modules.module
    if any((hooks._global_forward_hooks, hooks._global_forward_pre_hooks,
            hooks._global_backward_hooks, hooks._global_backward_pre_hooks)):
        raise Unkeyable("global module hooks are registered")
    return (torch.__version__, torch.is_grad_enabled(), autocast,
            str(torch.get_default_dtype()))


def model_key(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
              ) -> tuple[Hashable | None, str]:
    """(key, "") for a model and inputs whose export can be reused, else (None, reason)."""
    k = _Keyer()
    parts: list[Hashable] = []
    try:
        parts.append(_global_state())
        first_module: dict[int, str] = {}
        first_tensor: dict[int, str] = {}
        for path, mod in model.named_modules(remove_duplicate=False):
            hooked = [h for h in _HOOKS if getattr(mod, h, None)]
            if hooked:
                raise Unkeyable(f"module {path or '<root>'!r} has {', '.join(hooked)}")
            attrs = {a: v for a, v in vars(mod).items() if a not in _MODULE_INTERNALS}
            tensors: list[Hashable] = []
            for kind, named in (("param", mod._parameters), ("buffer", mod._buffers)):
                for name, t in named.items():
                    if t is None:
                        tensors.append((kind, name, None))
                        continue
                    full = f"{path}.{name}" if path else name
                    tensors.append((kind, name, tuple(t.shape), str(t.dtype), t.device.type,
                                    t.requires_grad, name in mod._non_persistent_buffers_set,
                                    first_tensor.setdefault(id(t), full)))
            parts.append((path, _code(type(mod), f"module {path or '<root>'!r}"), mod.training,
                          first_module.setdefault(id(mod), path),
                          k.value(attrs, f"module {path or '<root>'!r}"), tuple(tensors)))
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        parts.append((str(spec), tuple(_leaf(k, x, f"input {i}") for i, x in enumerate(leaves))))
        key: Hashable = tuple(parts)
        hash(key)
    except Unkeyable as why:
        return None, str(why)
    except TypeError as exc:  # an unhashable value deep in an attribute
        return None, f"a value cannot be hashed ({exc})"
    return key, ""


def _without_state(ep: Any, model: nn.Module) -> Any:
    """A copy of the program exported from ``model`` that holds none of its tensors: what
    ``recall`` fills with another model's. The constants that are the model's own
    (non-persistent buffers, tensor attributes) are dropped too; those the forward made
    (lifted ``torch.tensor(...)`` values) stay: they follow from the code and the key."""
    kept = copy.copy(ep)
    kept._state_dict = {name: None for name in ep.state_dict}
    kept._constants = {name: (None if tensor_at(model, name) is value else value)
                       for name, value in ep.constants.items()}
    kept._example_inputs = None
    return kept


def remember(key: Hashable, ep: Any, model: nn.Module) -> None:
    """Keep ``ep`` (exported from ``model``) under ``key``, without its tensors
    (``_without_state``). A program that keeps its tensors other than where this torch's
    does (``_state_dict``, ``_constants``) is not kept."""
    if not all(isinstance(getattr(ep, a, None), dict) for a in ("_state_dict", "_constants")):
        unkeyed(f"torch {torch.__version__}'s ExportedProgram keeps its tensors elsewhere")
        return
    _PROGRAMS[key] = _without_state(ep, model)
    _PROGRAMS.move_to_end(key)
    while len(_PROGRAMS) > CAPACITY:
        _PROGRAMS.popitem(last=False)
    STATS.stored += 1


def recall(key: Hashable, model: nn.Module) -> Any | None:
    """The program remembered under ``key`` holding ``model``'s tensors, or None."""
    kept = _PROGRAMS.get(key)
    if kept is None:
        return None
    ep = copy.copy(kept)
    state: dict[str, torch.Tensor] = {}
    for name in kept.state_dict:
        tensor = tensor_at(model, name)
        if tensor is None:
            return None
        state[name] = tensor
    constants: dict[str, Any] = {}
    for name, value in kept.constants.items():
        constants[name] = tensor_at(model, name) if value is None else value
        if constants[name] is None:
            return None
    ep._state_dict = state
    ep._constants = constants
    _PROGRAMS.move_to_end(key)
    STATS.hits += 1
    return ep


def unkeyed(reason: str) -> None:
    """Count a model exported without the memo, and say why once per reason."""
    if reason not in STATS.unkeyed:
        log.info("export: not remembered for reuse (%s); a model of the same structure "
                 "built again in this process is exported again", reason)
    STATS.unkeyed[reason] += 1


__all__ = ["CAPACITY", "ENV", "STATS", "MemoStats", "Unkeyable", "clear", "enabled",
           "model_key", "recall", "remember", "unkeyed"]
