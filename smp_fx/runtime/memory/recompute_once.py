"""Activation checkpointing whose recompute serves the split backward's I and W alike.

torch's checkpoint rebuilds a region per backward pass, and I and W are two; here the
first pass rebuilds it once and the frame keeps what it saved until W.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from smp_fx.runtime.executor.modes import Autocast, autocast_state, thread_modes
from smp_fx.runtime.memory.activations import rebuild_sink


class _Keep(torch.autograd.Function):
    """Saves the region's inputs through the outer hooks; never runs backward."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*inputs)
        return anchor.detach()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # pragma: no cover - never reached
        return (None,) * (1 + len(ctx.saved_tensors))


class _Frame:
    """One forward of one region: how to rebuild it, and what the rebuild saved."""

    def __init__(self, run: Callable[..., Any], inputs: tuple[Any, ...],
                 preserve_rng_state: bool) -> None:
        self.run = run
        self.layout = [isinstance(x, torch.Tensor) for x in inputs]
        self.needs_grad = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
        self.others = [x for x in inputs if not isinstance(x, torch.Tensor)]
        tensors = [x.detach() for x in inputs if isinstance(x, torch.Tensor)]
        with torch.enable_grad():
            self.keeper = _Keep.apply(torch.empty(0, requires_grad=True), *tensors)
        self.autocast: Autocast = autocast_state()
        self.rng: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        if preserve_rng_state:
            cuda = [x.device for x in tensors if x.device.type == "cuda"]
            self.rng = (torch.get_rng_state(),
                        [torch.cuda.get_rng_state(d) for d in dict.fromkeys(cuda)])
            self.cuda_devices = list(dict.fromkeys(cuda))
        self.count = 0
        self.rebuilt: list[torch.Tensor] | None = None
        self.rebuilt_bytes = 0
        self.sink = rebuild_sink()  # the microbatch's record when activations are counted

    def pack(self, t: torch.Tensor) -> tuple[_Frame, int]:
        index = self.count
        self.count += 1
        return (self, index)

    def rebuild(self) -> None:
        saved = iter(self.keeper.grad_fn.saved_tensors)
        others = iter(self.others)
        args = [next(saved).detach().requires_grad_(g) if is_t else next(others)
                for is_t, g in zip(self.layout, self.needs_grad)]
        got: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> None:
            got.append(t)

        with torch.random.fork_rng(devices=getattr(self, "cuda_devices", []),
                                   enabled=self.rng is not None):
            if self.rng is not None:
                torch.set_rng_state(self.rng[0])
                for d, state in zip(self.cuda_devices, self.rng[1]):
                    torch.cuda.set_rng_state(state, d)
            with thread_modes(True, self.autocast), saved_tensors_hooks(keep, _never):
                self.run(*args)
        if len(got) != self.count:
            raise RuntimeError(f"a checkpointed region saved {self.count} values in its "
                               f"forward and {len(got)} in its recompute")
        self.rebuilt = got
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in got
                    if isinstance(t, torch.Tensor)}
        self.rebuilt_bytes = sum(storages.values())
        if self.sink is not None:
            self.sink(self.rebuilt_bytes)


def _never(handle: Any) -> torch.Tensor:  # the recompute's own graph is never run
    raise RuntimeError("a checkpointed region's recompute graph was run")


def _unpack(handle: tuple[_Frame, int]) -> torch.Tensor:
    frame, index = handle
    if frame.rebuilt is None:
        frame.rebuild()
    assert frame.rebuilt is not None
    return frame.rebuilt[index]


def checkpoint_once(run: Callable[..., Any], *inputs: Any,
                    preserve_rng_state: bool = True) -> Any:
    """``run(*inputs)``, saving only the inputs; the first backward pass that needs a saved
    value rebuilds them all, once, for every later pass too."""
    frame = _Frame(run, inputs, preserve_rng_state)
    with saved_tensors_hooks(frame.pack, _unpack):
        return run(*inputs)
