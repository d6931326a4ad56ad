"""Compiled stages (``compile``, an smp-fx extension): each local stage under ``torch.compile``.

A stage is an fx ``GraphModule`` already, the form dynamo takes best. Its forward is
compiled whole (``fullgraph``) once per input signature (dynamo's guards; a new sequence
length recompiles once, then the dimension is dynamic); AOTAutograd makes the forward one
autograd function whose backward is compiled too. Every compile is counted per stage.

What cannot compile runs eagerly from then on, its reason logged in one line and kept in
``CompileStats.fallback``: a graph break or an untraceable op, dynamo's recompile limit
(raised while tracing, before the graph runs, so no collective has started), a split
backward's stage that receives gradients (its I and W are two autograd passes through one
node), sharded data parallelism.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cost_model.schedule import SPLIT_BACKWARD
from smp_fx.runtime.executor.seams import StageRunner

log = logging.getLogger("smp_fx.compile")

@dataclass
class CompileStats:
    """One stage's compilation: ``compiles`` (1 + recompiles), the seconds the forwards that
    compiled took (``compile_s``; a backward inductor compiles at its first call is not in
    it), and why it runs eagerly (``fallback``, None if it does not)."""

    stage: int
    compiles: int = 0
    compile_s: float = 0.0
    fallback: str | None = None

    @property
    def recompiles(self) -> int:
        return max(self.compiles - 1, 0)


class CompiledStage(nn.Module):
    """A stage module called through ``torch.compile``; its parameters stay the stage's own
    (``stage`` is its one submodule, so data parallelism wrapping this sees them)."""

    _compiled: Callable[..., Any]

    def __init__(self, stage: nn.Module, backend: str, stats: CompileStats) -> None:
        super().__init__()
        self.stage = stage
        self.stats = stats
        # its forward, not the module: dynamo caches per code object, and a compiled module's
        # is one wrapper every compiled module shares (one recompile limit for all stages);
        # a stage's generated forward is its own, and a stage has no module hooks
        compiled = torch.compile(stage.forward, backend=_counting(backend, stats),
                                 fullgraph=True)
        object.__setattr__(self, "_compiled", compiled)  # not a submodule: no second name

    def forward(self, *inputs: Any) -> Any:
        if self.stats.fallback is not None:
            return self.stage(*inputs)
        before, start = self.stats.compiles, time.perf_counter()
        try:
            out = self._compiled(*inputs)
        except (torch._dynamo.exc.TorchDynamoException,
                torch._dynamo.exc.FailOnRecompileLimitHit) as exc:  # dynamo's recompile limit
            fall_back(self.stats, _reason(exc))
            return self.stage(*inputs)
        if self.stats.compiles != before:
            self.stats.compile_s += time.perf_counter() - start
        return out


def _counting(backend: str, stats: CompileStats) -> Callable[..., Any]:
    """``backend`` that counts (and logs) each graph it compiles for the stage."""
    real = torch._dynamo.lookup_backend(backend)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        stats.compiles += 1
        if stats.compiles > 1:
            log.info("smp-fx compile: stage %d recompiled (%d compiles): a guard failed (a new "
                     "input shape or dtype, grad mode, a module's mode)", stats.stage,
                     stats.compiles)
        return real(gm, example_inputs)

    return compile_graph


def fall_back(stats: CompileStats, reason: str) -> None:
    """Stage ``stats.stage`` runs eagerly from now on, for ``reason`` (logged once)."""
    stats.fallback = reason
    log.warning("smp-fx compile: stage %d runs eagerly: %s", stats.stage, reason)


def _reason(exc: BaseException) -> str:
    """Dynamo's error in one line: what failed, its explanation, where in the stage."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines()]
    words = [f"{type(exc).__name__}: {lines[0] if lines else ''}"]
    words += [ln.removeprefix("Explanation: ") for ln in lines if ln.startswith("Explanation:")]
    words += [ln for ln in lines if ln.startswith("File ")][-1:]
    return "; ".join(words)


def eager_reason(runner: StageRunner, pipeline: str, sharded: bool) -> str | None:
    """Why ``runner``'s stage cannot run compiled in this configuration, or None."""
    if sharded:
        return ("sharded data parallelism (FSDP2) gathers parameters in module hooks that "
                "the stage's compiled graph does not take in")
    if pipeline in SPLIT_BACKWARD and runner.stage.recvs:
        return (f"pipeline '{pipeline}' splits the backward into input and weight gradients, "
                "two autograd passes through a compiled stage's one backward node, which "
                "would compute both in each")
    return None


def compile_stages(runners: Mapping[int, StageRunner], backend: str, pipeline: str,
                   sharded: bool = False) -> dict[int, CompileStats]:
    """Give each runner a ``CompiledStage`` module (in place; before data parallelism wraps
    it) and return the per-stage statistics; a stage that cannot compile is told now."""
    stats: dict[int, CompileStats] = {}
    for s, runner in sorted(runners.items()):
        stats[s] = CompileStats(s)
        reason = eager_reason(runner, pipeline, sharded)
        if reason is not None:
            fall_back(stats[s], reason)
        runner.module = CompiledStage(runner.module, backend, stats[s])
    log.info("smp-fx compile: stages %s with backend %s", sorted(runners), backend)
    return stats
