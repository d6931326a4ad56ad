"""``smp.step`` and ``StepOutput``.

The decorated function runs once per microbatch, on every rank, with its tensor arguments
split along the batch axis (``smp_fx.runtime.microbatch``). Inside it ``model(...)`` and
``model.backward(...)`` are the pipeline's turns (``smp_fx.runtime.conductor``). Its return
values come back per microbatch: tensors as ``StepOutput`` (``outputs`` list,
``reduce_mean``, ``reduce_sum``, ``concat``, ``stack``), other values as lists, keeping
tuple/list/dict structure. The first call partitions the model, traced on the first microbatch.

    @smp.step
    def train_step(model, data, target):
        output = model(data)
        loss = F.nll_loss(output, target)
        model.backward(loss)
        return output, loss

    _, loss_mb = train_step(model, data, target)
    loss = loss_mb.reduce_mean()
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from cost_model.errors import SMPRuntimeError
from smp_fx.dist import state
from smp_fx.runtime import context
from smp_fx.runtime.microbatch import split_inputs

if TYPE_CHECKING:
    from smp_fx.model import DistributedModel


class StepOutput:
    """One value returned by an ``smp.step`` function, for every microbatch."""

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = outputs

    def reduce_mean(self) -> torch.Tensor:
        """Mean over microbatches (of equal-sized microbatches: the batch mean)."""
        return torch.stack([torch.as_tensor(o) for o in self.outputs]).mean(0)

    def reduce_sum(self) -> torch.Tensor:
        return torch.stack([torch.as_tensor(o) for o in self.outputs]).sum(0)

    def concat(self) -> torch.Tensor:
        """Concatenate along the batch axis: the whole batch's values."""
        return torch.cat(self.outputs)

    def stack(self) -> torch.Tensor:
        return torch.stack(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def __repr__(self) -> str:
        return f"StepOutput({len(self.outputs)} microbatches)"


def _combine(values: list[Any], detach: bool) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return StepOutput([v.detach() if detach else v for v in values])
    if isinstance(first, tuple) and not hasattr(first, "_fields") and \
            all(isinstance(v, tuple) and len(v) == len(first) for v in values):
        return tuple(_combine([v[i] for v in values], detach) for i in range(len(first)))
    if isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys()
                                       for v in values):
        return {k: _combine([v[k] for v in values], detach) for k in first}
    return list(values)


def step(fn: Callable[..., Any] | None = None, *, non_split_inputs: Sequence[str] = (),
         input_split_axes: Mapping[str, int] | None = None,
         detach_outputs: bool = True) -> Any:
    """Decorate a training or evaluation step (bare ``@smp.step`` or with options)."""
    if fn is None:
        return functools.partial(step, non_split_inputs=non_split_inputs,
                                 input_split_axes=input_split_axes,
                                 detach_outputs=detach_outputs)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model = context.current_model()
        if model is None:
            raise SMPRuntimeError.build(
                "an smp.step function needs an smp.DistributedModel", None, fn.__name__,
                "wrap the model with smp.DistributedModel(model) before the first step")
        cfg = state.get().config
        m = cfg.microbatches
        mbs = split_inputs(args, kwargs, m, non_split_inputs, input_split_axes, fn)
        if not model.partitioned:
            _partition_on(model, fn, mbs[0])
        forward_only = not torch.is_grad_enabled()
        schedule = model.schedule(m, forward_only)
        scale = 1.0 / m if model.options.average_grads_across_microbatches else 1.0
        scale *= model.loss_scale  # fp16: the optimizer's loss scale
        results = model.executor.run(fn, mbs, schedule, scale)
        return _combine(results, detach_outputs)

    return wrapper


def _partition_on(model: DistributedModel, fn: Callable[..., Any],
                  mb: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
    """Run ``fn`` on the first microbatch only until it calls the model; partition there."""
    try:
        with context.capturing(), torch.no_grad():
            fn(*mb[0], **mb[1])
    except context.Captured as cap:
        model._partition(cap.args, cap.kwargs, cap.autocast)
        return
    raise SMPRuntimeError.build(
        "the smp.step function returned without calling the DistributedModel", fn.__name__,
        "first smp.step call (partitioning)", "call model(...) inside the step function")
