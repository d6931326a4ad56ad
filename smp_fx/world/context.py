"""Who is running: the process's ``DistributedModel``, and what the calling thread is inside.

The model, the thread's turn and the first step's capture are read far from where they
are set, so they live below every reader (no import cycles), naming what they hold by
protocols: ``ProcessModel``, ``ProcessOptimizer``, ``TurnTaker``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from passes.tensor_parallel import TensorParallelPlan


class ProcessModel(Protocol):
    """The process's ``smp.DistributedModel``, as checkpoints, marking and the optimizer
    read it."""

    @property
    def tp_plan(self) -> TensorParallelPlan | None: ...
    @property
    def partitioned(self) -> bool: ...

    def get_module(self) -> nn.Module: ...
    def script_module(self) -> nn.Module | None: ...
    def owns_parameters(self, params: Iterable[torch.Tensor]) -> bool: ...
    def register_post_partition_hook(self, hook: Callable[..., Any]) -> RemovableHandle: ...
    def local_state_dict(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any: ...


class ProcessOptimizer(Protocol):
    """An ``smp.DistributedOptimizer``, as checkpoints and a later model read it."""

    def parameters_held(self) -> list[torch.Tensor]: ...
    def local_state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...


class TurnTaker(Protocol):
    """The conductor as a step function's ``model(...)`` and ``model.backward`` ask it."""

    def forward_request(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> Any: ...
    def backward_request(self, mb: int, tensors: Any, grad_tensors: Any) -> None: ...


_tls = threading.local()
_model: weakref.ref[ProcessModel] | None = None
_waiting: list[weakref.ref[ProcessOptimizer]] = []
_optimizer: weakref.ref[ProcessOptimizer] | None = None
_tracing = False


class Captured(BaseException):
    """Raised by ``model(...)`` while capturing: the first microbatch's model inputs.

    A ``BaseException`` so that a step function's ``except Exception`` cannot swallow it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                 autocast: tuple[Any, ...] = ()) -> None:
        super().__init__("captured")
        self.args, self.kwargs = args, kwargs
        self.autocast = autocast  # the step function's autocast at its model(...) call


class _Capturing:
    """The turn of a thread that captures model inputs instead of running a stage."""


def current_model() -> ProcessModel | None:
    """The DistributedModel of this process, or None."""
    return _model() if _model is not None else None


def set_current_model(model: ProcessModel) -> None:
    global _model
    _model = weakref.ref(model)


def clear_current_model() -> None:
    """No DistributedModel in this process any more, nor optimizers (``smp.reset()``)."""
    global _model, _optimizer
    _model = _optimizer = None
    _waiting.clear()


def current_optimizer() -> ProcessOptimizer | None:
    """The last DistributedOptimizer created in this process (SMP's ``state.optimizer``)."""
    return _optimizer() if _optimizer is not None else None


def set_current_optimizer(optimizer: ProcessOptimizer) -> None:
    global _optimizer
    _optimizer = weakref.ref(optimizer)


def wait_for_model(optimizer: ProcessOptimizer) -> None:
    """``optimizer`` was built before the DistributedModel whose parameters it holds (the
    Hugging Face Trainer's order: its optimizer exists before it wraps the model)."""
    _waiting.append(weakref.ref(optimizer))


def waiting_optimizers() -> list[ProcessOptimizer]:
    """The optimizers still waiting for their DistributedModel (alive ones, oldest first)."""
    alive = [opt for opt in (ref() for ref in _waiting) if opt is not None]
    _waiting[:] = [weakref.ref(opt) for opt in alive]
    return alive


def stop_waiting(optimizer: ProcessOptimizer) -> None:
    _waiting[:] = [ref for ref in _waiting if ref() is not optimizer and ref() is not None]


def is_tracing() -> bool:
    """True while the model is being traced and partitioned (the first ``smp.step`` call)."""
    return _tracing


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """``is_tracing()`` is True inside."""
    global _tracing
    _tracing = True
    try:
        yield
    finally:
        _tracing = False


def turn() -> tuple[TurnTaker, int] | None:
    """The (conductor, microbatch) whose step function the calling thread runs, else None."""
    ctx = getattr(_tls, "ctx", None)
    return None if isinstance(ctx, _Capturing) else ctx


def capturing_inputs() -> bool:
    """Whether ``model(...)`` in this thread must raise ``Captured`` (see ``capturing``)."""
    return isinstance(getattr(_tls, "ctx", None), _Capturing)


def enter_turn(conductor: TurnTaker, microbatch: int) -> None:
    """The calling thread now runs ``microbatch``'s step function for ``conductor``."""
    _tls.ctx = (conductor, microbatch)


def leave_turn() -> None:
    _tls.ctx = None


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Inside it, ``model(...)`` raises ``Captured`` with its inputs and ``is_tracing()``
    is True (``smp.step`` partitions on the first microbatch this way)."""
    prev = getattr(_tls, "ctx", None)
    _tls.ctx = _Capturing()
    try:
        with tracing():
            yield
    finally:
        _tls.ctx = prev
