"""A split backward's stage compiled whole: its weight GEMMs' gradients wait for W outside it.

Compiled whole, a stage is one autograd node, so its input (I) and weight (W) gradients
cannot come from two passes through it (docs/schedules.md, 'The split backward'). Here each
GEMM on a trainable stage parameter becomes ``_DeferredMatmul``: its backward gives the
input's gradient and hands the output's gradient ``dy`` to an extra graph input, the GEMM's
*sink*, instead of computing ``dW``. The graph also returns each GEMM's input ``x``. The
sink is made outside the graph by ``_Sink`` from the weight, so autograd joins them there:

    weight --_Sink--> sink --+
                             +--> compiled stage --> outputs
    inputs ------------------+

I asks autograd for the inputs' and sinks' gradients (and those of the parameters read
inside the graph: norms, biases, embeddings), which runs the compiled backward once and
frees it; W runs ``_Sink``'s backward from the sinks with the ``dy`` I got, each computing
``dW = dy^T x`` into the weight's ``.grad`` through its accumulator (data parallelism's
hooks fire as in any backward). The GEMMs' weight gradients, most of W's work, still wait
for W, and nothing else of the stage leaves the compiled graph: the Llama example's second
stage runs a microbatch's forward, I and W in 0.58 of the time it takes cut into compiled
regions between eager GEMMs (``compiled_regions``), 0.55 of eager's
(``benchmarks/split_compile.py``; docs/performance.md, 'Compiled stages').

A sink must have the GEMM output's shape before the graph runs; the shapes come from
running the plain stage on fake tensors once per input signature (``SinkShapes``); where
they cannot, the stage runs eagerly, its I and W from its autograd graph, and says why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import get_gradient_edge

from passes.tensor_parallel.linears import as_linear
from smp_fx.runtime.executor.split_backward import Accumulators, PendingW, input_grads

_KINDS = ("linear", "addmm", "matmul")
"""``as_linear``'s layouts deferred (``grouped`` experts stay inside the graph)."""


class _DeferredMatmul(torch.autograd.Function):
    """``x @ w.T`` (``out_in``: ``w`` is (out, in), else ``x @ w``) whose backward gives
    ``x`` its gradient and ``sink`` the output's, and ``w`` none."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, sink: torch.Tensor,
                out_in: bool) -> torch.Tensor:
        ctx.save_for_backward(w)
        ctx.out_in = out_in
        return x @ (w.t() if out_in else w)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (w,) = ctx.saved_tensors
        w = w.to(dy.dtype)
        return dy @ (w if ctx.out_in else w.t()), None, dy, None


def deferred_matmul(x: torch.Tensor, w: torch.Tensor, sink: torch.Tensor,
                    out_in: bool) -> torch.Tensor:
    """The graph's call of ``_DeferredMatmul`` (a function: fx calls it by name)."""
    out: torch.Tensor = _DeferredMatmul.apply(x, w, sink, out_in)
    return out


class _Held:
    """A GEMM's input ``x`` for one microbatch, filled once the graph has run."""

    x: torch.Tensor | None = None


class _Sink(torch.autograd.Function):
    """A zero tensor of the GEMM output's shape (no memory: one element, expanded) whose
    backward is the GEMM's weight gradient from ``dy`` and the held ``x``."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, held: _Held, shape: tuple[int, ...],
                dtype: torch.dtype, out_in: bool) -> torch.Tensor:
        ctx.held, ctx.out_in, ctx.wdtype = held, out_in, w.dtype
        return torch.zeros((), dtype=dtype, device=w.device).expand(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x = ctx.held.x
        assert x is not None, "a GEMM's input is held once its stage's forward returned"
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype)
        dw = dy2.t() @ x2 if ctx.out_in else x2.t() @ dy2
        return dw.to(ctx.wdtype), None, None, None, None


@dataclass(frozen=True)
class Deferred:
    """A stage rewritten by ``defer_gemms``: ``module`` takes the stage's inputs then one sink
    per GEMM and returns the stage's outputs (``outputs`` of them) then each GEMM's input;
    ``weights``: each GEMM's weight, ``out_in`` its layout, ``nodes``: the GEMM's node
    name in the stage's graph (where its output shape is read)."""

    module: torch.fx.GraphModule
    weights: tuple[nn.Parameter, ...]
    out_in: tuple[bool, ...]
    nodes: tuple[str, ...]
    outputs: int
    tupled: bool


def defer_gemms(gm: torch.fx.GraphModule) -> Deferred:
    """``gm`` (left as it was) with each GEMM on a trainable parameter deferred (see the
    module docstring); its bias, if any, added after it inside the graph."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    out = graph.graph_copy(gm.graph, env, return_output_node=True)
    assert isinstance(out, tuple) and len(out) == 2
    result: Any = out[0]  # the copied output's value (graph_copy leaves the output node out)
    tupled = isinstance(result, (tuple, list))
    values: list[Any] = list(result) if tupled else [result]
    output = graph.output(tuple(values))
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}
    weights: list[nn.Parameter] = []
    out_in: list[bool] = []
    names: list[str] = []
    inputs: list[torch.fx.Node] = []
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for n in list(gm.graph.nodes):
        lin = as_linear(gm, n)
        if lin is None or lin.kind not in _KINDS or not lin.weight_value.requires_grad:
            continue
        new = env[n]
        with graph.inserting_after(placeholders[-1] if placeholders else None):
            sink = graph.placeholder(f"smp_sink_{len(weights)}")
        placeholders.append(sink)
        with graph.inserting_before(new):
            w = graph.get_attr(lin.weight)
            x = replaced.get(env[lin.x], env[lin.x])
            y = graph.call_function(deferred_matmul, (x, w, sink, lin.kind != "addmm"))
            if lin.bias is not None:
                y = graph.call_function(torch.add, (y, graph.get_attr(lin.bias)))
        reads = [a for a in new.all_input_nodes if a.op == "get_attr"]
        new.replace_all_uses_with(y)
        graph.erase_node(new)
        replaced[new] = y
        for view in reversed(lin.views):  # the weight's transpose, now unused
            graph.erase_node(env[view])
        for read in reads:  # the weight's and bias's own reads, now unused
            if not read.users:
                graph.erase_node(read)
        weights.append(lin.weight_value)  # type: ignore[arg-type]
        out_in.append(lin.kind != "addmm")
        names.append(n.name)
        inputs.append(x)
    replaced_values: Any = output.args[0]  # the stage's outputs, their GEMMs replaced
    output.args = ((*replaced_values, *inputs),)
    graph.lint()
    module = torch.fx.GraphModule(gm, graph)
    return Deferred(module, tuple(weights), tuple(out_in), tuple(names), len(values), tupled)


class SinkShapes:
    """Each deferred GEMM's output shape and dtype for the stage's inputs, found by running
    the plain stage on fake tensors (no kernel, no collective, no random draw) once per input
    signature."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: Sequence[str]) -> None:
        self._gm, self._nodes = gm, set(nodes)
        self._order = list(nodes)
        self._cache: dict[Any, tuple[tuple[tuple[int, ...], torch.dtype], ...]] = {}

    def __call__(self, inputs: Sequence[Any]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        key: Any = tuple((tuple(t.shape), t.dtype, t.requires_grad)
                         if isinstance(t, torch.Tensor) else t for t in inputs)
        try:
            hash(key)
        except TypeError:  # a list among the values
            key = repr(key)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._propagate(inputs)
        return hit

    def _propagate(self, inputs: Sequence[Any]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        wanted = self._nodes

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                value = super().run_node(n)
                if n.name in wanted:
                    found[n.name] = (tuple(int(d) for d in value.shape), value.dtype)
                return value

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, torch.no_grad():
            fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
            Recorder(self._gm).run(*fake)
        return tuple(found[name] for name in self._order)


class DeferredStage(nn.Module):
    """A stage run as its ``Deferred`` rewrite through ``run`` (its compiled call, which falls
    back to the rewrite run eagerly); ``stage`` stays the one submodule, so its parameters
    keep their names. Each forward's sinks wait in the thread's slot until the runner files
    them under their microbatch (``take``), for ``input_grads``.

    Where the GEMMs' shapes cannot be found on fake tensors (an op without a fake kernel, a
    shape that depends on values), the stage runs as it is, eagerly, from then on, I and W
    taken from its autograd graph (``split_backward``); ``fall_back`` is told why once."""

    _run: nn.Module

    def __init__(self, stage: torch.fx.GraphModule, deferred: Deferred, run: nn.Module,
                 fall_back: Callable[[str], None]) -> None:
        super().__init__()
        self.stage = stage
        self.deferred = deferred
        object.__setattr__(self, "_run", run)  # not a submodule: no second name
        self.fall_back = fall_back
        self.fallback: str | None = None
        self.accumulators = Accumulators()
        self.shapes = SinkShapes(stage, deferred.nodes)
        ids = {id(w) for w in deferred.weights}
        self.graph_params = tuple(p for p in stage.parameters()
                                  if p.requires_grad and id(p) not in ids)
        self._last = threading.local()  # microbatches' forwards may run in threads
        self._sinks: dict[int, list[torch.Tensor]] = {}

    def forward(self, *inputs: Any) -> Any:
        d = self.deferred
        shapes = self._shapes(inputs)
        if shapes is None:
            self._last.sinks = None
            return self.stage(*inputs)
        held = [_Held() for _ in d.weights]
        sinks = [_Sink.apply(w, h, shape, dtype, oi) for w, h, (shape, dtype), oi
                 in zip(d.weights, held, shapes, d.out_in)]
        values = self._run(*inputs, *sinks)
        for h, x in zip(held, values[d.outputs:]):
            h.x = x.detach()
        self._last.sinks = sinks if torch.is_grad_enabled() else None
        outs = tuple(values[:d.outputs])
        return outs if d.tupled else outs[0]

    def _shapes(self, inputs: Sequence[Any]
                ) -> tuple[tuple[tuple[int, ...], torch.dtype], ...] | None:
        """The sinks' shapes, or None once they could not be found (then told, once)."""
        if self.fallback is None:
            try:
                return self.shapes(inputs)
            except Exception as exc:  # whatever fake tensors could not run
                first = (str(exc).strip().splitlines() or [""])[0]
                self.fallback = (f"its GEMMs' output shapes could not be found on fake "
                                 f"tensors ({type(exc).__name__}: {first}); the stage runs "
                                 "eagerly, its I and W from its autograd graph")
                self.fall_back(self.fallback)
        return None

    def take(self, microbatch: int) -> None:
        """File the sinks of this thread's last forward under ``microbatch``."""
        sinks = getattr(self._last, "sinks", None)
        self._last.sinks = None
        if sinks is not None:
            self._sinks[microbatch] = sinks

    def drop(self, microbatch: int) -> None:
        """Forget ``microbatch``'s sinks (its backward ran whole: W's work went with it)."""
        self._sinks.pop(microbatch, None)

    def input_grads(self, roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor], microbatch: int
                    ) -> tuple[list[torch.Tensor | None], PendingW]:
        """I: the inputs' gradients, and W's work: each sink with its ``dy``, and the
        gradients of the parameters read inside the graph (accumulated by W, so their
        hooks fire with the rest)."""
        if microbatch not in self._sinks and self.fallback is not None:
            return input_grads(roots, root_grads, inputs, list(self.stage.parameters()),
                               self.accumulators)
        sinks = self._sinks.pop(microbatch, [])
        used = [(r, g) for r, g in zip(roots, root_grads) if r.requires_grad]
        if not used:
            return [None] * len(inputs), PendingW([])
        wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        params = [p for p in self.graph_params if p.requires_grad]
        asked: Any = [*wanted, *sinks, *map(get_gradient_edge, params)]
        got = torch.autograd.grad([r for r, _ in used], asked, [g for _, g in used],
                                  allow_unused=True)
        it = iter(got[:len(wanted)])
        grads = [next(it) if isinstance(t, torch.Tensor) and t.requires_grad else None
                 for t in inputs]
        dys = got[len(wanted):len(wanted) + len(sinks)]
        kept = [(s, dy, w) for s, dy, w in zip(sinks, dys, self.deferred.weights)
                if dy is not None]
        pending = PendingW([], [s for s, _, _ in kept], [dy for _, dy, _ in kept],
                           list({id(w): w for _, _, w in kept}.values()))
        pending.shared = [(get_gradient_edge(p), g) for p, g
                          in zip(params, got[len(wanted) + len(sinks):]) if g is not None]
        return grads, pending

