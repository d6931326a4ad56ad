"""Compiled stages (``compile``, an smp-fx extension): each local stage under ``torch.compile``.

A stage is an fx ``GraphModule`` already, the form dynamo takes best. Its forward is
compiled whole (``fullgraph``) once per input signature (dynamo's guards; a new sequence
length recompiles once, then the dimension is dynamic); AOTAutograd makes the forward one
autograd function whose backward is compiled too. Under a split backward a stage that
receives gradients is compiled whole with its GEMMs' weight gradients deferred to W
(``deferred_gemms``), so its I and W stay two passes; a stage with checkpointed regions
rebuilt once (untraceable) is compiled in regions between those and, if it receives
gradients, its GEMMs (``compiled_regions``). Every compile is counted per stage (and region).

What cannot compile runs eagerly from then on, its reason logged in one line and kept in
``CompileStats.fallback`` (a region's in its own): a graph break or an untraceable op,
dynamo's recompile limit (raised while tracing, before the graph runs, so no collective has
started). Under sharded data parallelism a stage compiles whole as one FSDP2 unit, its
hooks outside the graph; a stage that cannot (a split backward's that receives gradients,
one whose parameters gathered at once exceed ``sdp_max_live_parameters``) runs eagerly,
sharded in units.

AOTAutograd's on-disk cache is off while a stage compiles (``without_autograd_cache``: a
lazily compiled backward saving its entry can crash the process).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cost_model.schedule import SPLIT_BACKWARD
from smp_fx.runtime.executor.compiled_regions import CompiledRegions, cut_at_gemms, region_params
from smp_fx.runtime.executor.deferred_gemms import DeferredStage, defer_gemms
from smp_fx.runtime.executor.seams import StageRunner
from smp_fx.runtime.memory.checkpointing import RegionCall

log = logging.getLogger("smp_fx.compile")

@dataclass
class CompileStats:
    """One stage's compilation: ``compiles`` (1 + recompiles), the seconds the forwards that
    compiled took (``compile_s``; a backward inductor compiles at its first call is not in
    it), and why it runs eagerly (``fallback``, None if it does not). A stage compiled in
    regions (``compiled_regions``) counts its regions' compiles and keeps each region's own
    statistics (``regions``, each with its own ``params``), its eager ``gemms`` and
    ``checkpointed`` regions, and how many of its ``params`` (trainable tensors) are read
    inside the regions (``region_params``; ``region_share`` of the elements): I computes
    their gradients. A stage compiled whole with ``deferred`` GEMMs (``deferred_gemms``)
    counts the parameters read inside its graph in ``region_params`` too. ``unaliased``:
    the gradients ``unalias_gradients`` copied before autograd kept them."""

    stage: int
    compiles: int = 0
    compile_s: float = 0.0
    fallback: str | None = None
    region: str | None = None
    regions: list[CompileStats] = field(default_factory=list)
    params: int = 0
    gemms: int = 0
    checkpointed: int = 0
    region_params: int = 0
    region_share: float = 0.0
    deferred: int = 0
    unaliased: int = 0

    @property
    def recompiles(self) -> int:
        if self.regions:
            return sum(r.recompiles for r in self.regions)
        return max(self.compiles - 1, 0)

    @property
    def eager_regions(self) -> int:
        return sum(r.fallback is not None for r in self.regions)

    @property
    def where(self) -> str:
        return f"stage {self.stage}" + (f" region {self.region}" if self.region else "")

    def summary(self) -> str:
        """One line: what of the stage runs compiled, what eagerly (and its parameters), and
        how many gradients ``unalias_gradients`` copied."""
        copied = (f"; {self.unaliased} gradients copied out of another's memory"
                  if self.unaliased else "")
        return self._parts() + copied

    def _parts(self) -> str:
        if self.fallback is not None:
            return f"{self.where}: eager, {self.params} parameters ({self.fallback})"
        if self.deferred:
            return (f"{self.where}: compiled whole, {self.deferred} GEMMs' weight gradients "
                    f"deferred to W; parameters {self.region_params} in I, "
                    f"{self.params - self.region_params} in W")
        if not self.regions and not self.checkpointed and not self.gemms:
            if self.compiles == 0:
                return (f"{self.where}: nothing compiled yet, {self.params} parameters (not "
                        "run, or no tensor operation reached the compiler)")
            return f"{self.where}: compiled whole, {self.params} parameters"
        compiled = sum(r.params for r in self.regions if r.fallback is None)
        kept = f", {self.checkpointed} checkpointed eager" if self.checkpointed else ""
        return (f"{self.where}: {len(self.regions) - self.eager_regions} regions compiled, "
                f"{self.eager_regions} eager, {self.gemms} GEMMs eager{kept}; parameters "
                f"{compiled} compiled, {self.params - compiled} eager")


class CompiledStage(nn.Module):
    """A stage module called through ``torch.compile``; its parameters stay the stage's own
    (``stage`` is its one submodule, so data parallelism wrapping this sees them); a region's
    compiles are counted in its stage's ``counts`` too. ``hooked``: the stage is called
    through its module hooks (sharded data parallelism's, which gather its parameters
    before the compiled forward runs): its ``forward`` becomes the compiled one."""

    _compiled: Callable[..., Any]
    _eager: Callable[..., Any]

    def __init__(self, stage: nn.Module, backend: str, stats: CompileStats,
                 counts: CompileStats | None = None, hooked: bool = False) -> None:
        super().__init__()
        self.stage = stage
        self.stats = stats
        self.hooked = hooked
        # its forward, not the module: dynamo caches per code object, and a compiled module's
        # is one wrapper every compiled module shares (one recompile limit for all stages);
        # a stage's generated forward is its own; hooks stay outside the graph
        eager = stage.forward
        compiled = torch.compile(eager, fullgraph=True,
                                 backend=_counting(backend, stats, counts))
        object.__setattr__(self, "_compiled", compiled)  # not a submodule: no second name
        object.__setattr__(self, "_eager", eager if hooked else stage)
        unalias_gradients([p for p in stage.parameters() if p.requires_grad], stats)
        if hooked:  # the instance's forward: __call__ runs the hooks, then this
            object.__setattr__(stage, "forward", self._run)

    def forward(self, *inputs: Any) -> Any:
        return self.stage(*inputs) if self.hooked else self._run(*inputs)

    def _run(self, *inputs: Any) -> Any:
        """The compiled forward, or the eager one once the stage has fallen back."""
        if self.stats.fallback is not None:
            return self._eager(*inputs)
        before, start = self.stats.compiles, time.perf_counter()
        try:
            out = self._compiled(*inputs)
        except (torch._dynamo.exc.TorchDynamoException,
                torch._dynamo.exc.FailOnRecompileLimitHit) as exc:  # dynamo's recompile limit
            fall_back(self.stats, _reason(exc))
            return self._eager(*inputs)
        if self.stats.compiles != before:
            self.stats.compile_s += time.perf_counter() - start
        return out


def _counting(backend: str, stats: CompileStats, counts: CompileStats | None
              ) -> Callable[..., Any]:
    """``backend`` that counts (and logs) each graph it compiles for the stage (or region)."""
    real = torch._dynamo.lookup_backend(backend)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        stats.compiles += 1
        if counts is not None:
            counts.compiles += 1
        if stats.compiles > 1:
            log.info("smp-fx compile: %s recompiled (%d compiles): a guard failed (a new "
                     "input shape or dtype, grad mode, a module's mode)", stats.where,
                     stats.compiles)
        with without_autograd_cache():
            return real(gm, example_inputs)

    return compile_graph


def without_autograd_cache() -> contextlib.AbstractContextManager[Any]:
    """AOTAutograd's on-disk cache off while a stage's graph compiles (one flag, read at
    compile time only: no cost per call).

    Why: with it on, a backward compiled lazily (at its first run: the first chunk's under a
    split backward runs in W) pickles its cache entry there, and that ``pickle.dumps``
    crashes the process now and then (SIGSEGV; PyTorch issue #177442, open: 10-30 % of runs
    with a cold inductor cache in its report; here rank 0 of ``benchmarks/random_cuts.py
    --features compile_zbv`` in two of four full sweeps from a cold cache). What it costs:
    AOTAutograd's own cache hits in a later process; inductor's compiled-code cache still
    serves them. A stage's first step with the caches warm (``benchmarks/split_compile.py``):
    compiled in regions 4.4 -> 6.5-6.9 s, compiled whole with deferred GEMMs 3.7 -> 2.9-3.2 s.
    """
    patched: contextlib.AbstractContextManager[Any] = torch._functorch.config.patch(
        enable_autograd_cache=False)
    return patched


def unalias_gradients(params: list[nn.Parameter], stats: CompileStats) -> None:
    """Copy a compiled backward's gradient that shares its storage with another parameter's
    gradient of the same backward, before autograd accumulates it.

    Why: AOTAutograd may return one parameter's gradient as a view of another's (ViT's
    ``cls_token`` gradient is the first row of ``position_embeddings``' when a microbatch
    holds one image), and autograd keeps a gradient it is handed whole as ``.grad`` without
    copying it, even a view (PyTorch issue #34082, open). The two ``.grad`` then share
    memory, and the next microbatch's in-place accumulation into one adds to the other: ViT
    compiled at two microbatches of one image counted the second image's ``cls_token``
    gradient twice. What it costs: a copy of each such gradient in a step's first backward
    (one 64-element tensor on that ViT; later microbatches accumulate in place, no copy),
    and a Python hook call per parameter per backward: ~1 us each on this CPU (a 30-parameter
    stack's backward 335 -> 366 us).
    Each copy is counted in ``stats.unaliased`` and logged once per stage."""
    claims: dict[int, tuple[nn.Parameter, weakref.ref[torch.Tensor]]] = {}  # address ->
    held: dict[int, int] = {}  # id(parameter) -> the address it claimed last (bounds claims)

    def shared(key: int, param: nn.Parameter) -> bool:
        """Whether another parameter keeps storage ``key``: as its ``.grad``, or in a
        gradient of this backward not accumulated yet (still alive)."""
        other, grad = claims.get(key, (param, None))
        if other is param:
            return False
        kept = other.grad
        return (_address(kept) == key if kept is not None
                else grad is not None and grad() is not None)

    def hook_for(param: nn.Parameter) -> Callable[[torch.Tensor | None], torch.Tensor | None]:
        def hook(grad: torch.Tensor | None) -> torch.Tensor | None:
            if grad is None or grad.numel() == 0:  # no gradient (a graph output left unused)
                return None
            if param.grad is not None:
                return None  # accumulated into .grad in place: nothing of it is kept
            key = _address(grad)
            if key is None:
                return None
            if shared(key, param):
                if stats.unaliased == 0:
                    log.warning("smp-fx compile: %s: the compiled backward gave a parameter's "
                                "gradient in another's memory (PyTorch issue #34082); it is "
                                "copied before it is accumulated", stats.where)
                stats.unaliased += 1
                return grad.clone()
            last = held.get(id(param))  # its claim from an earlier step, if still its own
            if last is not None and claims.get(last, (None,))[0] is param:
                del claims[last]
            claims[key], held[id(param)] = (param, weakref.ref(grad)), key
            return None

        return hook

    for param in params:
        param.register_hook(hook_for(param))


def _address(t: torch.Tensor) -> int | None:
    """Where ``t``'s memory starts, or None for a tensor without plain storage (sparse, a
    tensor subclass such as DTensor): those ``unalias_gradients`` leaves alone."""
    if t.layout != torch.strided:
        return None
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def fall_back(stats: CompileStats, reason: str) -> None:
    """``stats``'s stage (or region) runs eagerly from now on, for ``reason`` (logged once)."""
    stats.fallback = reason
    log.warning("smp-fx compile: %s runs eagerly: %s", stats.where, reason)


def _reason(exc: BaseException) -> str:
    """Dynamo's error in one line: what failed, its explanation, where in the stage."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines()]
    words = [f"{type(exc).__name__}: {lines[0] if lines else ''}"]
    words += [ln.removeprefix("Explanation: ") for ln in lines if ln.startswith("Explanation:")]
    words += [ln for ln in lines if ln.startswith("File ")][-1:]
    return "; ".join(words)


OneUnit = Callable[[torch.fx.GraphModule], "str | None"]
"""Under sharded data parallelism: why a stage cannot be sharded as one unit, or None
(``smp_fx.parallel.sdp.one_unit_refusal``)."""


def sharded_reason(runner: StageRunner, split: bool, one_unit: OneUnit) -> str | None:
    """Why ``runner``'s stage cannot compile under sharded data parallelism, or None: it
    compiles whole as one FSDP2 unit, the hooks that gather and free its parameters on the
    stage module, outside the graph (as torchtitan compiles each FSDP2-wrapped block)."""
    gm = runner.module
    if split:
        return ("sharded data parallelism with a split backward: this stage would compile "
                "in parts (its GEMMs' weight gradients deferred to W, or regions between "
                "checkpointed ones rebuilt once), outside the module FSDP2 hooks; it runs "
                "eagerly, sharded in units")
    if not isinstance(gm, torch.fx.GraphModule) or gm is not runner.stage.module:
        return (f"sharded data parallelism: its module is a {type(gm).__name__}, not the "
                "stage's GraphModule that FSDP2 hooks")
    return one_unit(gm)


def _no_donated_buffers() -> None:
    """I runs a region's compiled backward with the graph kept for W, which AOTAutograd refuses
    for a backward allowed to reuse its saved buffers (donated buffers: memory, not values).
    The setting is read in the thread running the backward (the engine's, on a GPU) and a
    setting made in Python holds for its thread only, so the default changes, process-wide."""
    config: Any = torch._functorch.config
    entry = getattr(config, "_config", {}).get("donated_buffer")
    if entry is None:  # a torch without donated buffers (or another config layout)
        return
    config.donated_buffer = False  # a value set in this thread would hide the default
    if entry.default:
        entry.default = False
        log.info("smp-fx compile: AOTAutograd's donated buffers off in this process: a split "
                 "backward's I keeps the compiled regions' graphs for W")


def compile_in_regions(runner: StageRunner, backend: str, stats: CompileStats,
                       gemms: bool = True) -> str | None:
    """Compile a split backward's stage between its GEMMs (``compiled_regions``): it buys
    compiled norms, activations and attention while the GEMMs' weight gradients still wait
    for W. ``gemms`` False: between its checkpointed regions only. Gives ``runner`` the
    regions' module, or returns why its stage cannot be cut."""
    gm = runner.module
    if not isinstance(gm, torch.fx.GraphModule) or gm is not runner.stage.module:
        return (f"its module is a {type(gm).__name__}, not the stage's GraphModule: it cannot "
                "be cut into compiled regions, and compiled whole "
                + ("its input and weight gradients would be one autograd pass" if gemms else
                   "its checkpointed regions, rebuilt once (recompute_once), do not trace"))
    cut = cut_at_gemms(gm, gemms)
    if gemms:  # I keeps the graph for W only where there is an input path
        _no_donated_buffers()
    held = region_params(cut)

    def compile_region(name: str, region: nn.Module) -> nn.Module:
        trainable = sum(p.requires_grad for p in held[name])
        stats.regions.append(CompileStats(stats.stage, region=name, params=trainable))
        return CompiledStage(region, backend, stats.regions[-1], counts=stats)

    runner.module = CompiledRegions(gm, cut, compile_region, stats)
    stats.checkpointed = len(cut.checkpointed)
    if cut.checkpointed:
        log.warning("smp-fx compile: stage %d: %d checkpointed regions run eagerly: under a "
                    "split backward each is rebuilt once for its I and W (recompute_once), "
                    "which dynamo does not trace", stats.stage, len(cut.checkpointed))
    if not gemms:  # no input path: W computes every gradient, none moves to I
        log.info("smp-fx compile: stage %d compiled in %d regions between its %d checkpointed "
                 "regions", stats.stage, len(cut.regions), len(cut.checkpointed))
        return None
    params = [p for p in gm.parameters() if p.requires_grad]
    inside = {id(p) for ps in held.values() for p in ps}
    stats.gemms, stats.region_params = len(cut.gemms), sum(id(p) in inside for p in params)
    total = sum(p.numel() for p in params)
    stats.region_share = sum(p.numel() for p in params if id(p) in inside) / max(total, 1)
    runner.input_path_params = tuple(p for p in params if id(p) in inside)
    log.info("smp-fx compile: stage %d compiled in %d regions between %d eager GEMMs; "
             "%d of its %d parameters (%.1f %% of the elements) are read inside them, "
             "their gradients computed in I", stats.stage, len(cut.regions), len(cut.gemms),
             stats.region_params, stats.params, 100 * stats.region_share)
    return None


def compile_deferred(runner: StageRunner, backend: str, stats: CompileStats) -> str | None:
    """Compile a split backward's stage whole with its GEMMs' weight gradients deferred to W
    (``deferred_gemms``): nothing of it leaves the compiled graph but those GEMMs' ``dW``.
    Gives ``runner`` the stage's module, or returns why its stage cannot be rewritten."""
    gm = runner.module
    if not isinstance(gm, torch.fx.GraphModule) or gm is not runner.stage.module:
        return (f"its module is a {type(gm).__name__}, not the stage's GraphModule: its GEMMs "
                "cannot be deferred, and compiled whole its input and weight gradients would "
                "be one autograd pass")
    deferred = defer_gemms(gm)
    stage = DeferredStage(gm, deferred, CompiledStage(deferred.module, backend, stats),
                          lambda reason: fall_back(stats, reason))
    runner.module = runner.deferred = stage
    stats.deferred, stats.region_params = len(deferred.weights), len(stage.graph_params)
    log.info("smp-fx compile: stage %d compiled whole with %d GEMMs' weight gradients deferred "
             "to W; the gradients of the %d parameters read inside it come from I",
             stats.stage, stats.deferred, stats.region_params)
    return None


def rebuilt_once(runner: StageRunner) -> bool:
    """Whether ``runner``'s stage has checkpointed regions rebuilt once (``recompute_once``),
    which dynamo does not trace: compiled whole, the stage would run eagerly."""
    return any(isinstance(n.target, RegionCall) and n.target.once
               for n in runner.stage.module.graph.nodes)


def compile_stages(runners: Mapping[int, StageRunner], backend: str, pipeline: str,
                   sharded: OneUnit | None = None) -> dict[int, CompileStats]:
    """Give each runner a ``CompiledStage`` module, or under a split backward a stage that
    receives gradients ``compile_deferred``'s, one that holds regions rebuilt once
    ``compile_in_regions``'s (in place; before data parallelism wraps it), and return the
    per-stage statistics; a stage that cannot compile is told now. ``sharded``: under
    sharded data parallelism, a stage compiles whole through its module hooks
    (``sharded_reason``; ``one_unit_stages`` names them for the sharding)."""
    stats: dict[int, CompileStats] = {}
    for s, runner in sorted(runners.items()):
        stats[s] = CompileStats(s, params=sum(p.requires_grad
                                              for p in runner.module.parameters()))
        gemms = bool(runner.stage.recvs)  # the first chunk's backward is all W
        once = rebuilt_once(runner)
        split = pipeline in SPLIT_BACKWARD and (gemms or once)
        if sharded is not None:
            reason = sharded_reason(runner, split, sharded)
            if reason is not None:
                fall_back(stats[s], reason)
            runner.module = CompiledStage(runner.module, backend, stats[s],
                                          hooked=reason is None)
            continue
        if split:
            reason = (compile_in_regions(runner, backend, stats[s], gemms) if once
                      else compile_deferred(runner, backend, stats[s]))
            if reason is None:
                continue
            fall_back(stats[s], reason)
        runner.module = CompiledStage(runner.module, backend, stats[s])
    log.info("smp-fx compile: stages %s with backend %s", sorted(runners), backend)
    return stats


def one_unit_stages(stats: Mapping[int, CompileStats]) -> frozenset[int]:
    """The stages compiled under sharded data parallelism: each sharded as one unit."""
    return frozenset(s for s, st in stats.items() if st.fallback is None)
