"""Which modules tensor parallelism distributes: ``smp.tensor_parallelism`` and
``smp.set_tensor_parallelism``; a mark is an attribute holding ``(enabled, kwargs)``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import nn

from passes.tensor_parallel import TensorParallelism
from smp_fx.marking.init_tape import cutting

if TYPE_CHECKING:
    from smp_fx.config import SMPConfig

ATTR = "_smp_tensor_parallel"
CREATED = "_smp_tp_created"
"""Set on a module created inside an enabled ``smp.tensor_parallelism`` context (also
``smp.model_creation``): SMP's Hugging Face replacements apply to those only
(``smp_fx.marking.tp_register``)."""

_stack = threading.local()
_original_init = nn.Module.__init__


def _contexts() -> list[tuple[bool, dict[str, Any]]]:
    if not hasattr(_stack, "items"):
        _stack.items = []
    items: list[tuple[bool, dict[str, Any]]] = _stack.items
    return items


def _marking_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    ctx = _contexts()
    if ctx and ATTR not in self.__dict__:
        object.__setattr__(self, ATTR, (ctx[-1][0], dict(ctx[-1][1])))
        object.__setattr__(self, CREATED, ctx[-1][0])


def mark(module: nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Mark one module (no recursion)."""
    object.__setattr__(module, ATTR, (bool(enabled), dict(kwargs)))


@contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Modules created inside are distributed when ``enabled`` (SMP's context manager); the
    rewrite takes its settings from the configuration, not ``kwargs``."""
    ctx = _contexts()
    ctx.append((bool(enabled), dict(kwargs)))
    if len(ctx) == 1:
        nn.Module.__init__ = _marking_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        ctx.pop()
        if not ctx:
            nn.Module.__init__ = _original_init  # type: ignore[method-assign]


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Enable (or disable) tensor parallelism for ``module`` and its submodules."""
    for m in module.modules():
        mark(m, enabled, **kwargs)


def is_marked(module: nn.Module) -> bool:
    value = module.__dict__.get(ATTR)
    return bool(value and value[0])


def created_marked(module: nn.Module) -> bool:
    """Marked, and created inside an enabled ``smp.tensor_parallelism`` context (not only
    marked afterwards by ``smp.set_tensor_parallelism``)."""
    return is_marked(module) and bool(module.__dict__.get(CREATED))


def marked_paths(model: nn.Module) -> tuple[str, ...]:
    """Paths of the outermost marked-enabled modules of ``model`` ('' = the root)."""
    out: list[str] = []
    for path, m in model.named_modules():
        if is_marked(m) and not any(path == o or path.startswith(o + ".") or o == ""
                                    for o in out):
            out.append(path)
    return tuple(out)


def rewrite_inputs(cfg: SMPConfig, rank: int, model: nn.Module) -> TensorParallelism:
    """What the tensor-parallel rewrite needs of a configuration and a model for tp rank
    ``rank``: the one translation ``DistributedModel`` and ``smp-fx partition`` share
    (degree, batch semantics, the marked modules, ``optimize: "memory"`` -> sequence
    chunks; shards of delayed-init weights recorded as cut from them)."""
    return TensorParallelism(cfg.tensor_parallel_degree, rank, cfg.prescaled_batch,
                             marked_paths(model), sequence_parallel=cfg.optimize == "memory",
                             cutting=cutting)
