"""``smp.step`` and ``StepOutput``.

The decorated function runs once per microbatch, on every rank, with its tensor arguments
split along the batch axis (``smp_fx.runtime.inputs.microbatch``). Inside it ``model(...)`` and
``model.backward(...)`` are the pipeline's turns (``smp_fx.runtime.executor.conductor``). Its
return
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
from typing import Any

import torch

from cost_model.errors import SMPRuntimeError
from smp_fx.ckpt import async_save
from smp_fx.model import DistributedModel
from smp_fx.runtime.inputs.input_check import batch_agrees_over_groups, first_rank_inputs
from smp_fx.runtime.inputs.microbatch import split_inputs
from smp_fx.world import context, order_mode, state


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

    def detach(self) -> StepOutput:
        """The same outputs detached from autograd (the Hugging Face Trainer's
        ``smp_nested_concat`` calls ``output.detach().concat()``)."""
        return StepOutput([o.detach() if isinstance(o, torch.Tensor) else o
                           for o in self.outputs])

    def map(self, fn: Callable[[Any], Any]) -> StepOutput:
        """Apply ``fn`` to each microbatch's output, in place (as SMP's), and return self."""
        self.outputs = [fn(o) for o in self.outputs]
        return self

    def __getitem__(self, microbatch: int) -> Any:
        return self.outputs[microbatch]

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


def step(non_split_inputs: Callable[..., Any] | Sequence[str] | None = None,
         input_split_axes: Mapping[str, int] | None = None, detach_outputs: bool = True,
         func: Callable[..., Any] | None = None) -> Any:
    """Decorate a training or evaluation step.

    Every form SMP scripts use works: bare ``@smp.step``, ``@smp.step()``, keywords
    (``@smp.step(non_split_inputs=["x"])``) and the documented positional form
    ``@smp.step(non_split_inputs, input_split_axes, detach_outputs)``, e.g.
    ``@smp.step(["x"])``. A callable in the first position is the function itself (the
    bare decorator), which a list of argument names never is; ``func=`` (the name SMP's
    own implementation uses) passes the function explicitly.

    >>> @step(["scale"], {"x": 0})
    ... def f(model, x, scale): ...
    >>> f.__name__
    'f'
    """
    if callable(non_split_inputs):
        if func is not None:
            raise SMPRuntimeError.build(
                "smp.step got two step functions", (non_split_inputs, func), "smp.step",
                "pass the function once: @smp.step or smp.step(func=f)")
        func, non_split_inputs = non_split_inputs, None
    names = _check_names(non_split_inputs, input_split_axes)
    if func is None:
        return functools.partial(step, names, input_split_axes, detach_outputs)
    fn = func

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model = context.current_model()
        if not isinstance(model, DistributedModel):
            raise SMPRuntimeError.build(
                "an smp.step function needs an smp.DistributedModel", None, fn.__name__,
                "wrap the model with smp.DistributedModel(model) before the first step")
        async_save.at_step()  # a checkpoint in flight: its writers' agreement launched
        st = state.get()
        cfg = st.config
        m = cfg.microbatches
        # the first pipeline rank's inputs (placeholders elsewhere replaced; the first call
        # of each step function checks that real data agrees)
        args, kwargs = first_rank_inputs(model, fn, args, kwargs, st)
        batch_agrees_over_groups(model, fn, args, kwargs, st)
        mbs = split_inputs(args, kwargs, m, names, input_split_axes, fn)
        if not model.partitioned:
            _partition_on(model, fn, mbs[0])
        forward_only = not torch.is_grad_enabled()
        schedule = model.schedule(m, forward_only)
        scale = 1.0 / m if model.options.average_grads_across_microbatches else 1.0
        scale *= model.loss_scale  # fp16: the optimizer's loss scale
        with order_mode.checked_step():  # SMP_FX_CHECK_ORDER: compare the step's calls
            results = model.executor.run(fn, mbs, schedule, scale)
            model.run_post_step_hooks()
        async_save.after_step()  # a checkpoint written meanwhile: commit or raise
        return _combine(results, detach_outputs)

    return wrapper


def _check_names(non_split_inputs: Any, input_split_axes: Any) -> tuple[str, ...]:
    """The argument names of ``non_split_inputs``; bad options fail at decoration, before
    any step runs (a bare string would otherwise be read as a list of letters)."""
    if non_split_inputs is None:
        names: tuple[str, ...] = ()
    elif isinstance(non_split_inputs, str) or not all(
            isinstance(n, str) for n in non_split_inputs):
        raise SMPRuntimeError.build(
            "smp.step's non_split_inputs must be a list of argument names",
            non_split_inputs, "smp.step", 'pass e.g. ["mask"] (a list, also for one name)')
    else:
        names = tuple(non_split_inputs)
    if input_split_axes is not None and not (
            isinstance(input_split_axes, Mapping)
            and all(isinstance(k, str) and isinstance(v, int)
                    for k, v in input_split_axes.items())):
        raise SMPRuntimeError.build(
            "smp.step's input_split_axes must map argument names to axes",
            input_split_axes, "smp.step", 'pass e.g. {"x": 1}')
    return names


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
