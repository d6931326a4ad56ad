"""Measured costs: real forward/backward times and saved-activation bytes.

Measuring runs on one rank and the result is broadcast, so every rank makes the same plan;
saved bytes are what autograd's pack hooks really see, deduplicated by storage.
See docs/partitioning.md.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from cost_model.microbench import clock

Measured = dict[str, tuple[float, float, int]]


class SavedCounter:
    """Counts bytes autograd saves, deduplicated by storage, excluding ``exclude``."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = {_storage_key(t) for t in exclude}
        self.seen: set[int] = set()
        self.by_owner: dict[str, int] = {}
        self.owner = ""

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.excluded and key not in self.seen:
            self.seen.add(key)
            nbytes = t.untyped_storage().nbytes()
            self.by_owner[self.owner] = self.by_owner.get(self.owner, 0) + nbytes
        return t

    @property
    def total(self) -> int:
        return sum(self.by_owner.values())

    @contextmanager
    def hooks(self) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self


@contextmanager
def preserved_state(module: nn.Module) -> Any:
    """Measuring must leave no trace on the user's model: restore every buffer (batch-norm
    running statistics move in a training-mode forward) and every ``.grad`` afterwards."""
    buffers = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    grads = [(p, p.grad) for p in module.parameters()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def saved_bytes_by_module(model: nn.Module, args: tuple[Any, ...],
                          kwargs: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Run ``model`` once; bytes saved for backward per innermost running module ('' = root)."""
    paths = {id(m): p for p, m in model.named_modules()}
    state = [*model.parameters(), *model.buffers()]
    counter = SavedCounter(state)
    stack: list[str] = [""]

    def pre(mod: nn.Module, _args: Any) -> None:
        if id(mod) in paths:
            stack.append(paths[id(mod)])
            counter.owner = stack[-1]

    def post(mod: nn.Module, _args: Any, _out: Any) -> None:
        if id(mod) in paths and len(stack) > 1:
            stack.pop()
            counter.owner = stack[-1]

    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    h1 = register_module_forward_pre_hook(pre)
    h2 = register_module_forward_hook(post)
    try:
        with preserved_state(model), torch.enable_grad(), counter.hooks():
            model(*args, **dict(kwargs or {}))
    finally:
        h1.remove()
        h2.remove()
    return dict(counter.by_owner)


def _median_time(fn: Callable[[Any], Any], setup: Callable[[], Any], warmup: int,
                 repeats: int, sync: Callable[[], None],
                 now: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    """Median seconds of ``fn(setup())``; ``setup`` (fresh inputs) is not timed."""
    result = None
    for _ in range(warmup):
        result = fn(setup())
    times = []
    for _ in range(repeats):
        inputs = setup()
        sync()
        t0 = now()
        result = fn(inputs)
        sync()
        times.append(now() - t0)
    return statistics.median(times), result


def _fresh_inputs(value: Any) -> Any:
    """A detached copy of every tensor, re-marked as needing grad where it did, so each
    repeat builds its own small autograd graph rooted at this node. The copy is a clone
    (not a leaf) so in-place ops (``ReLU(inplace=True)``, ``+=``) are allowed on it."""
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            fresh = x.detach()
            if x.requires_grad:
                fresh = fresh.requires_grad_(True).clone()
            else:
                fresh = fresh.clone()
            return fresh
        return x
    return pytree.tree_map(one, value)


class _Recorder(torch.fx.Interpreter):
    """Runs the graph once for real and keeps every node's value."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        self.values[n.name] = result
        return result


def _flat_inputs(gm: torch.fx.GraphModule, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> list[Any]:
    """Map (args, kwargs) onto placeholders (export graphs flatten them with pytree)."""
    codegen = gm.graph._codegen
    if getattr(codegen, "pytree_info", None) is not None:
        return list(codegen.process_inputs(*args, **kwargs))
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    return list(args) + [kwargs[name] for name in names[len(args):] if name in kwargs]


def _views(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.view_as(x) for x in xs)


def _grad_inputs(inputs: Any) -> int:
    return sum(1 for t in pytree.tree_leaves(inputs)
               if isinstance(t, torch.Tensor) and t.requires_grad)


@dataclass(frozen=True)
class Harness:
    """What timing one node adds to its own time, taken off every node so measured and
    analytic node times sum to stage times alike."""

    forward_s: float
    backward_base_s: float
    backward_per_input_s: float

    def backward(self, grad_inputs: int) -> float:
        return self.backward_base_s + grad_inputs * self.backward_per_input_s

    @classmethod
    def measure(cls, interp: torch.fx.Interpreter, warmup: int, repeats: int,
                sync: Callable[[], None], now: Callable[[], float]) -> Harness:
        x = torch.zeros(4, requires_grad=True)
        fwd_s: dict[int, float] = {}
        bwd_s: dict[int, float] = {}
        for k in (1, 2):
            def setup(k: int = k) -> tuple[Any, ...]:
                return tuple(_fresh_inputs(x) for _ in range(k))

            def fwd(inputs: tuple[Any, ...]) -> Any:
                with torch.enable_grad():
                    return interp.call_function(_views, inputs, {})

            def both(inputs: tuple[Any, ...]) -> None:
                outs = fwd(inputs)
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

            # the lowest of a few medians: a load spike here would be taken off every node
            fwd_s[k] = min(_median_time(fwd, setup, warmup + 2, repeats + 4, sync, now)[0]
                           for _ in range(3))
            bwd_s[k] = min(_median_time(both, setup, warmup + 2, repeats + 4, sync, now)[0]
                           for _ in range(3)) - fwd_s[k]
        per_input = max(bwd_s[2] - bwd_s[1], 0.0)
        return cls(fwd_s[1], max(bwd_s[1] - per_input, 0.0), per_input)


def measure_nodes(gm: torch.fx.GraphModule, args: tuple[Any, ...],
                  kwargs: Mapping[str, Any] | None = None, *, times: bool = True,
                  memory: bool = True, warmup: int = 1, repeats: int = 3) -> Measured:
    """Time each node forward and backward (median of ``repeats``) and count its saved bytes.

    Returns ``{node name: (fwd_s, bwd_s, saved_bytes)}``; the model's state is preserved."""
    with preserved_state(gm):
        return _measure(gm, args, dict(kwargs or {}), times, memory, warmup, repeats)


def _measure(gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any],
             times: bool, memory: bool, warmup: int, repeats: int) -> Measured:
    interp = _Recorder(gm)
    with torch.enable_grad():
        interp.run(*_flat_inputs(gm, args, kwargs))
    values = interp.values
    cuda = any(p.is_cuda for p in gm.parameters())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    now = clock(torch.device("cuda" if cuda else "cpu"))
    state = [*gm.parameters(), *gm.buffers()]
    harness = Harness.measure(interp, warmup, repeats, sync, now) if times else Harness(0, 0, 0)
    out: Measured = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        call = getattr(interp, node.op)

        def setup(node: torch.fx.Node = node) -> tuple[Any, Any]:
            fresh = lambda a: _fresh_inputs(values[a.name])
            return (torch.fx.node.map_arg(node.args, fresh),
                    torch.fx.node.map_arg(node.kwargs, fresh))

        def fwd(inputs: tuple[Any, Any], call: Any = call, node: torch.fx.Node = node) -> Any:
            with torch.enable_grad():
                return call(node.target, *inputs)

        def bwd(inputs: tuple[Any, Any], fwd: Callable[[Any], Any] = fwd) -> None:
            outs = [t for t in pytree.tree_leaves(fwd(inputs))
                    if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

        fwd_s = bwd_s = 0.0
        if times:
            fwd_s, result = _median_time(fwd, setup, warmup, repeats, sync, now)
            if any(isinstance(t, torch.Tensor) and t.requires_grad
                   for t in pytree.tree_leaves(result)):
                total_s, _ = _median_time(bwd, setup, warmup, repeats, sync, now)
                bwd_s = max(total_s - fwd_s - harness.backward(_grad_inputs(setup())), 0.0)
            fwd_s = max(fwd_s - harness.forward_s, 0.0)
        saved = 0
        if memory:
            inputs = setup()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                keep = fwd(inputs)
                saved = max(torch.cuda.max_memory_allocated() - before, 0)
            else:
                counter = SavedCounter(state)
                with counter.hooks():
                    keep = fwd(inputs)
                saved = counter.total
            del keep, inputs
        out[node.name] = (float(fwd_s), float(bwd_s), int(saved))
    return out


def fake_module_cost(module: nn.Module,
                     make_inputs: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]],
                     ) -> tuple[float, float, int]:
    """(forward FLOPs, backward FLOPs, saved bytes) of an opaque module, run on fake tensors.

    ``make_inputs`` runs inside the fake mode; data-dependent modules raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    memo: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, t in (*module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False)):
        if id(t) not in memo:
            with mode:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            memo[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(
                t, nn.Parameter) else fake
        state[name] = memo[id(t)]
    with mode:
        return _counted(module, state, make_inputs)


def real_module_cost(module: nn.Module,
                     make_inputs: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]],
                     ) -> tuple[float, float, int]:
    """``fake_module_cost`` for a module that branches on its values and so cannot run on
    fake tensors: one forward and backward on real tensors (``make_inputs``' values, e.g.
    zeros), its weights read in place, its buffers copied, the random state put back, so
    the model and its training are untouched. Its FLOPs are those of the branches these
    values take."""
    memo: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        state[name] = memo.setdefault(id(p), p.detach().requires_grad_(p.requires_grad))
    for name, b in module.named_buffers(remove_duplicate=False):
        state[name] = memo.setdefault(id(b), b.detach().clone())
    devices = sorted({t.device.index for t in memo.values()
                      if t.device.type == "cuda" and t.device.index is not None})
    with torch.random.fork_rng(devices=devices):
        return _counted(module, state, make_inputs)


def _counted(module: nn.Module, state: dict[str, torch.Tensor],
             make_inputs: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]],
             ) -> tuple[float, float, int]:
    """FLOPs of one forward and one backward of ``module`` with ``state`` for its tensors,
    and the bytes autograd saves that are not ``state``'s."""
    from torch.utils.flop_counter import FlopCounterMode

    excluded = {v.untyped_storage()._cdata for v in state.values()}
    seen: set[int] = set()
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        key = t.untyped_storage()._cdata
        if key not in excluded and key not in seen:
            seen.add(key)
            saved += t.untyped_storage().nbytes()
        return t

    args, kwargs = make_inputs()
    fwd_counter = FlopCounterMode(display=False)
    with fwd_counter, torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.func.functional_call(module, state, args, kwargs, strict=False)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    bwd_counter = FlopCounterMode(display=False)
    if outs:
        with bwd_counter:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return (float(fwd_counter.get_total_flops()), float(bwd_counter.get_total_flops()),
            int(saved))
