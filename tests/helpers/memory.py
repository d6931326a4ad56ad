"""Train a small model with and without activation checkpointing and offloading.

``train`` builds ``mlp_stack`` (an ``nn.Sequential`` with dropout, layer norm and several
activations), pins children 0-3 to stage 0 and the rest to stage 1 (so the partition, and
with it the order in which dropout draws random numbers, is the same with and without
checkpointing), marks it with ``strategy`` and trains a few steps. It returns the losses,
the final parameters, the saved bytes counted per stage and microbatch by the stages'
saved-tensor hooks, and the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import smp_fx as smp
from cost_model.devices import load_device
from smp_fx.marking import activation_checkpointing
from smp_fx.runtime.memory.activations import SavedRecord
from smp_fx.world import state
from tests.helpers.numerics import init

STAGE_1_FROM = 4


def mlp_stack() -> nn.Sequential:
    """Eleven children; each group of two lies on one stage when split at child 4."""
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32),
        nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.1),
        nn.Linear(32, 32), nn.Linear(32, 4))


@dataclass
class Run:
    losses: list[float]
    params: dict[str, torch.Tensor]
    saved: dict[int, dict[int, SavedRecord]]
    plan: Any
    measured_memory: dict[int, int]
    """Per stage: parameter, gradient, buffer and optimizer-state bytes held after the last
    step, plus the bytes kept per microbatch times the most microbatches held at once."""


def train(strategy: str | None, offload: bool = False, steps: int = 2, m: int = 2,
          pipeline: str = "interleaved", ddp: bool = False, seed: int = 0,
          adam: bool = False) -> Run:
    """See the module docstring; ``strategy`` None trains without checkpointing."""
    load_device("cpu")  # the spec is measured once per process, before any seed is set
    init(2, m, pipeline, auto_partition=False, default_partition=0,
         offload_activations=offload, ddp=ddp)
    torch.manual_seed(seed)
    net = mlp_stack()
    for i in range(STAGE_1_FROM, len(net)):
        smp.set_partition(net[i], 1)
    model = smp.DistributedModel(net)
    if strategy is not None:
        smp.set_activation_checkpointing(net, strategy=strategy)
    inner = (torch.optim.Adam(net.parameters(), lr=1e-3) if adam
             else torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    opt = smp.DistributedOptimizer(inner)

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    gen = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    x, y = x.to(state.get().device), y.to(state.get().device)  # as an SMP script does
    losses = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        opt.zero_grad()
        out = step(model, x, y)
        if i == 0:
            for keeper in model.executor.keepers.values():
                keeper.track = True
        losses.append(out.reduce_mean().item())
        opt.step()
    saved = {s: dict(k.records) for s, k in model.executor.keepers.items()}
    params = {n: p.detach().clone() for n, p in model.local_named_parameters()}
    measured = {}
    for s in saved:  # this rank's stages
        stage = model.program.stages[s]
        ps = list(stage.module.parameters())
        state_bytes = sum(_nbytes(t) for p in ps for t in inner.state.get(p, {}).values())
        grads = sum(_nbytes(p.grad) for p in ps)
        kept = max(r.on_device for r in saved[s].values())
        measured[s] = (sum(_nbytes(p) for p in ps) + grads + state_bytes
                       + sum(_nbytes(b) for b in stage.module.buffers())
                       + kept * model.executor.stats.peak_in_flight[s])
    activation_checkpointing.clear(net)
    return Run(losses, params, saved, model.plan, measured)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
