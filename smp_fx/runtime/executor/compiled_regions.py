"""A split backward's stage compiled in regions: its GEMMs eager, everything between compiled.

A stage compiled whole is one autograd node, so its input (I) and weight (W) gradients
cannot come from two passes through it (docs/schedules.md, 'The split backward'). Cut at
each GEMM on a stage parameter, the GEMMs stay eager autograd nodes, the I/W joins, so their
weight gradients (most of W's work) still wait for W, while each run of nodes between them
(norms, activations, attention, residuals) is compiled. A compiled region's own parameters
(norm weights, unfused biases) are reached through the input path: I computes their gradients.
Checkpointed regions rebuilt once (``recompute_once``) are cut out too, and stay eager.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module

from passes import meta
from passes.tensor_parallel.graph import attr
from passes.tensor_parallel.linears import as_linear
from smp_fx.runtime.memory.checkpointing import RegionCall

if TYPE_CHECKING:
    from smp_fx.runtime.executor.compiled import CompileStats


@dataclass(frozen=True)
class Cut:
    """A stage cut at its GEMMs: ``module`` calls the submodules ``gemms`` (one GEMM each)
    and ``regions`` (the runs between them) in the stage's order; ``sizes``: the runs that
    compute no tensor (shapes read for views), not worth a compiled call; ``checkpointed``:
    its checkpointed regions, eager (rebuilt once for I and W, which dynamo cannot trace)."""

    module: torch.fx.GraphModule
    gemms: tuple[str, ...]
    regions: tuple[str, ...]
    sizes: tuple[str, ...] = ()
    checkpointed: tuple[str, ...] = ()


def cut_at_gemms(gm: torch.fx.GraphModule, at_gemms: bool = True) -> Cut:
    """``gm`` cut into GEMM submodules and region submodules (``gm`` is left as it was);
    ``at_gemms`` False: at its checkpointed regions only (a stage whose backward is all W)."""
    part: dict[torch.fx.Node, int] = {}
    gemm_parts: set[int] = set()
    checkpointed: set[int] = set()
    tensors: set[int] = set()
    pid, in_region = 0, False
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        lin = as_linear(gm, n) if at_gemms else None
        if lin is not None or isinstance(n.target, RegionCall):
            pid, in_region = pid + 1, False
            (gemm_parts if lin is not None else checkpointed).add(pid)
            for node in (*(lin.views if lin is not None else ()), n):  # W.T with its GEMM
                part[node] = pid
        elif n not in part:
            if not in_region:
                pid, in_region = pid + 1, True
            part[n] = pid
            if not meta.TENSOR.has(n) or meta.TENSOR.get(n) is not None:
                tensors.add(pid)
    module = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
    names = [str(n.target) for n in module.graph.nodes if n.op == "call_module"]
    gemms = tuple(f"submod_{p}" for p in sorted(gemm_parts))
    kept = tuple(f"submod_{p}" for p in sorted(checkpointed))
    sizes = tuple(f"submod_{p}" for p in range(1, pid + 1)
                  if p not in gemm_parts | checkpointed | tensors)
    return Cut(module, gemms, tuple(m for m in names if m not in gemms + sizes + kept),
               tuple(m for m in names if m in sizes), kept)


Compile = Callable[[str, nn.Module], nn.Module]
"""A region's name and module -> its compiled call (``compiled.CompiledStage``)."""


class CompiledRegions(nn.Module):
    """A stage run as its ``Cut`` (taken over), each region through ``compile`` (its own dynamo
    cache, counting and fallback); ``stage`` stays the one submodule, so its parameters keep
    their names. ``stats``: the stage's, counting every region's compiles."""

    _cut: torch.fx.GraphModule

    def __init__(self, stage: torch.fx.GraphModule, cut: Cut, compile: Compile,
                 stats: CompileStats) -> None:
        super().__init__()
        self.stage = stage
        self.stats = stats
        for name in cut.regions:
            setattr(cut.module, name, compile(name, getattr(cut.module, name)))
        object.__setattr__(self, "_cut", cut.module)  # not a submodule: no second name

    def forward(self, *inputs: Any) -> Any:
        before, start = self.stats.compiles, time.perf_counter()
        out = self._cut(*inputs)
        if self.stats.compiles != before:
            self.stats.compile_s += time.perf_counter() - start
        return out


def region_params(cut: Cut) -> dict[str, list[nn.Parameter]]:
    """Each region's parameters (held, or handed in by the cut module): autograd reaches them
    through the input path only, so a split backward's I computes their gradients."""
    params: dict[str, list[nn.Parameter]] = {}
    for n in cut.module.graph.nodes:
        if n.op != "call_module" or n.target not in cut.regions:
            continue
        handed = [attr(cut.module, str(a.target)) for a in n.all_input_nodes
                  if a.op == "get_attr"]
        own = cut.module.get_submodule(str(n.target)).parameters()
        mine = {id(p): p for p in (*own, *handed) if isinstance(p, nn.Parameter)}
        params[str(n.target)] = list(mine.values())
    return params
