"""``smp.tp_register`` and ``smp.tp_register_with_module``: a user's module class gets a
distributed version that replaces its tensor-parallel instances.

Registering wraps the class's ``__init__`` to record arguments; marked instances of
exactly that class are rebuilt as the distributed module (fresh weights, so build the
optimizer from ``DistributedModel.parameters()``) at every degree, 1 included.
See docs/tensor_parallel.md, 'API'.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from cost_model.errors import SMPConfigError
from smp_fx.marking.tensor_parallelism import ATTR, created_marked, is_marked, mark

log = logging.getLogger("smp_fx.marking.tp_register")
INIT_ARGS = "_smp_tp_init_args"
_PATCHED = "_smp_tp_patched_init"
M = TypeVar("M", bound=type[nn.Module])
Hook = Callable[..., Any]


@dataclass(frozen=True)
class Registration:
    """A registered class's distributed version and hooks; ``replacement`` is the
    ``dist_module`` subclass that applies the forward / return hooks."""

    dist_module: type[nn.Module]
    init_hook: Hook | None
    forward_hook: Hook | None
    return_hook: Hook | None
    replacement: type[nn.Module]


_REGISTRY: dict[type[nn.Module], Registration] = {}


def _check_class(value: Any, what: str, where: str) -> None:
    if not (isinstance(value, type) and issubclass(value, nn.Module)):
        raise SMPConfigError.build(f"{what} must be an nn.Module subclass", value, where,
                                   f"pass a module class as {what}")


def _same_signature(hook: Hook, method: Callable[..., Any], name: str, where: str) -> None:
    """SMP: the hook's signature is the method's without ``self`` (names, kinds), so the
    recorded arguments bind to it as they bound to the method. Defaults may differ, as
    SMP's runtime let them (AWS's ViT hooks): logged, since an argument a call omits then
    takes the hook's default."""
    try:
        want = list(inspect.signature(method).parameters.values())[1:]
        got = list(inspect.signature(hook).parameters.values())
    except (TypeError, ValueError):  # a builtin without a readable signature
        return
    if [(p.name, p.kind) for p in got] != [(p.name, p.kind) for p in want]:
        raise SMPConfigError.build(
            f"{name} must have the signature of {method.__qualname__} without self",
            f"({', '.join(map(str, got))}) for ({', '.join(map(str, want))})", where,
            f"define {name} with exactly the parameters of the original method")
    differ = [f"{h.name}={h.default!r} (method: {m.default!r})" for h, m in zip(got, want)
              if not _same_default(h.default, m.default)]
    if differ:
        log.debug("%s: %s differs from %s only in defaults, accepted; an argument a call "
                  "omits takes the hook's: %s", where, name, method.__qualname__,
                  ", ".join(differ))


def _same_default(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # a default whose == does not give one truth value (a tensor)
        return False


def _replacement(dist_module: type[nn.Module], forward_hook: Hook | None,
                 return_hook: Hook | None) -> type[nn.Module]:
    """The ``dist_module`` subclass whose ``forward`` translates arguments and output."""
    if forward_hook is None and return_hook is None:
        return dist_module
    base_forward = dist_module.forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if forward_hook is not None:
            args, kwargs = forward_hook(*args, **kwargs)
        out = base_forward(self, *args, **kwargs)
        return out if return_hook is None else return_hook(out)

    return type(f"Registered{dist_module.__name__}", (dist_module,),
                {"forward": forward, "__module__": dist_module.__module__,
                 "__doc__": f"{dist_module.__name__} with registered forward/return hooks."})


def _record_init_args(module_cls: type[nn.Module]) -> None:
    """Wrap ``module_cls.__init__`` (once) to keep each exact instance's arguments."""
    if module_cls.__dict__.get(_PATCHED):
        return
    original = module_cls.__init__

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self) is module_cls:
            object.__setattr__(self, INIT_ARGS, (args, dict(kwargs)))

    module_cls.__init__ = __init__  # type: ignore[method-assign]
    setattr(module_cls, _PATCHED, True)


def tp_register_with_module(module_cls: type[nn.Module], dist_module: type[nn.Module],
                            init_hook: Hook | None = None, forward_hook: Hook | None = None,
                            return_hook: Hook | None = None) -> None:
    """Register ``dist_module`` as the distributed version of ``module_cls``."""
    where = "smp.tp_register_with_module"
    _check_class(module_cls, "module_cls", where)
    _check_class(dist_module, "dist_module", where)
    for name, hook in (("init_hook", init_hook), ("forward_hook", forward_hook),
                       ("return_hook", return_hook)):
        if hook is not None and not callable(hook):
            raise SMPConfigError.build(f"{name} must be callable or None", hook, where,
                                       f"pass a function as {name}")
    if init_hook is not None:
        _same_signature(init_hook, module_cls.__init__, "init_hook", where)
    if forward_hook is not None:
        _same_signature(forward_hook, module_cls.forward, "forward_hook", where)
    _record_init_args(module_cls)
    _REGISTRY[module_cls] = Registration(dist_module, init_hook, forward_hook, return_hook,
                                         _replacement(dist_module, forward_hook, return_hook))


def tp_register(dist_module: type[nn.Module], init_hook: Hook | None = None,
                forward_hook: Hook | None = None,
                return_hook: Hook | None = None) -> Callable[[M], M]:
    """Class decorator: the decorated module class gets ``dist_module`` as its
    distributed version (``tp_register_with_module`` on it)."""
    _check_class(dist_module, "dist_module", "smp.tp_register")

    def decorate(module_cls: M) -> M:
        tp_register_with_module(module_cls, dist_module, init_hook, forward_hook, return_hook)
        return module_cls

    return decorate


def registration(module_cls: type) -> Registration | None:
    return _REGISTRY.get(module_cls)


def _distributed(module: nn.Module, reg: Registration, path: str) -> nn.Module:
    recorded = module.__dict__.get(INIT_ARGS)
    if recorded is None:
        raise SMPConfigError.build(
            f"{type(module).__name__} is registered with smp.tp_register but this instance "
            "was built before the registration (its arguments are unknown)", path,
            "smp.DistributedModel", "register the class before building the model")
    args, kwargs = recorded
    if reg.init_hook is not None:
        args, kwargs = reg.init_hook(*args, **kwargs)
    new = reg.replacement(*args, **kwargs)
    if not is_marked(new):  # a user's dist_module: it is the distributed version
        mark(new)
    return new


Predefined = Callable[[nn.Module, dict[str, Any]], nn.Module]
PREDEFINED_ATTR = "_smp_predefined_replacement"
"""Set on a module SMP's predefined replacement built."""
_PREDEFINED: dict[str, Predefined] = {}
"""SMP's own replacements (Hugging Face models, ``smp_fx.nn.huggingface``), by the class's
``module.QualName``: ``build(instance, tensor_parallelism kwargs)`` -> its distributed
version holding the instance's weights."""


def register_predefined(class_path: str, build: Predefined) -> None:
    """Register SMP's own distributed version of the class at ``class_path``."""
    _PREDEFINED[class_path] = build


def _class_path(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _replace_one(module: nn.Module, path: str) -> nn.Module | None:
    """The distributed version of a marked ``module``: a user's registration of its exact
    class first, then SMP's predefined one; None if neither applies."""
    if not is_marked(module):
        return None
    reg = _REGISTRY.get(type(module))
    if reg is not None:
        return _distributed(module, reg, path)
    build = _PREDEFINED.get(_class_path(module))
    if build is None or not created_marked(module):
        return None
    new = build(module, dict(module.__dict__[ATTR][1]))
    if not is_marked(new):
        mark(new)
    object.__setattr__(new, PREDEFINED_ATTR, True)
    return new


def replace_registered(model: nn.Module) -> nn.Module:
    """``model`` with its marked instances of registered classes replaced by their
    distributed versions (outermost first; a replacement is not searched again): the
    children in place; a replaced root is returned (``model`` itself otherwise)."""
    if not (_REGISTRY or _PREDEFINED):
        return model
    root = _replace_one(model, "<root>")
    if root is not None:
        return root

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in list(module.named_children()):
            path = f"{prefix}{name}"
            new = _replace_one(child, path)
            if new is not None:
                setattr(module, name, new)
            else:
                visit(child, path + ".")

    visit(model, "")
    _only_replacements_distributed(model)
    return model


def _only_replacements_distributed(model: nn.Module) -> None:
    """Where SMP's own replacement took a submodule (BERT's encoder), the rest of what was
    created with it for tensor parallelism (embeddings, pooler, heads) is left whole, as
    SMP distributes only the modules it supports; marks set with
    ``smp.set_tensor_parallelism`` or by ``smp.nn`` modules stay."""
    inside = {id(m) for r in model.modules() if getattr(r, PREDEFINED_ATTR, False)
              for m in r.modules()}
    if not inside:
        return
    for m in model.modules():
        if id(m) not in inside and created_marked(m):
            mark(m, False, **m.__dict__[ATTR][1])


__all__ = ["Registration", "registration", "replace_registered", "tp_register",
           "tp_register_with_module"]
