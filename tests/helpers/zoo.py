"""The tiny Hugging Face models of ``examples/models/hf_zoo.py`` trained the plain way: the
reference the tensor-parallel tests compare against.

``batches`` is the same seeded data for the reference and the distributed run;
``sgd_reference`` (``reference``: any optimizer) trains the unmarked model on it in this
process and returns each step's gradients and the final state dict; ``DistributedRun``
trains it as a ``DistributedModel`` under a configuration, a step at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from examples.models import hf_zoo

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def batches(arch: str, batch: int, steps: int, lengths: Sequence[int] = (hf_zoo.SEQ,)
            ) -> list[Batch]:
    """``steps`` seeded batches, step ``i`` of ``lengths[i % len(lengths)]`` tokens."""
    torch.manual_seed(1234)
    out = []
    for i in range(steps):
        seq = lengths[i % len(lengths)]
        out.append((hf_zoo.inputs(arch, batch, seq), hf_zoo.targets(arch, batch, seq)))
    return out


Optimizer = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def sgd_reference(arch: str, batch: int, steps: int, lr: float
                  ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process, the plain model, plain SGD: per-step gradients and the final state
    dict."""
    return reference(arch, batch, steps, lambda ps: torch.optim.SGD(ps, lr=lr))


def reference(arch: str, batch: int, steps: int, optimizer: Optimizer,
              attention: str = "eager", lengths: Sequence[int] = (hf_zoo.SEQ,)
              ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process, the plain model (``attention``: ``hf_zoo.build``'s), trained by
    ``optimizer(parameters)`` on ``batches(arch, batch, steps, lengths)``: per-step
    gradients and the final state dict."""
    model = hf_zoo.build(arch, marked=False, attention=attention)
    opt = optimizer(model.parameters())
    grads = []
    for x, y in batches(arch, batch, steps, lengths):
        opt.zero_grad()
        hf_zoo.loss_fn(model(*x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return grads, {k: v.clone() for k, v in model.state_dict().items()}


LAYER = re.compile(r"(layers?|h|block|blocks)\.\d+$")
"""The names of a model's repeated layers (Hugging Face's conventions)."""


class DistributedRun:
    """``arch`` as a DistributedModel under ``config`` (``smp.init``'s, after a reset that
    keeps the world: each run its own configuration and groups), trained by
    ``optimizer`` one step at a time, each data-parallel rank on its slice of the global
    batch; ``checkpointed``: every layer (``LAYER``) activation-checkpointed."""

    def __init__(self, arch: str, config: dict[str, Any], optimizer: Optimizer,
                 seed: int = 0, attention: str = "eager", checkpointed: bool = False) -> None:
        import smp_fx as smp
        from smp_fx.world import state

        smp.reset()
        state._reset()
        pipelined = config.get("pipeline_parallel_degree", 1) > 1
        smp.init({"ddp": True, "microbatches": 2 if pipelined else 1, **config})
        module = hf_zoo.build(arch, marked=smp.tp_size() > 1, seed=seed, attention=attention)
        self.model = smp.DistributedModel(module)
        if checkpointed:
            layers = [m for name, m in module.named_modules() if LAYER.search(name)]
            if not layers:
                raise ValueError(f"{arch}: no module named like a layer to checkpoint")
            for layer in layers:
                smp.set_activation_checkpointing(layer)
        self.opt = smp.DistributedOptimizer(optimizer(self.model.parameters()))

        @smp.step
        def train(model: Any, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> Any:
            loss = hf_zoo.loss_fn(model(*x), y)
            model.backward(loss)
            return loss

        self.train = train

    def step(self, batch: Batch) -> Any:
        """One optimizer step on this rdp rank's slice of ``batch``: the step's outputs."""
        import smp_fx as smp

        x, y = batch
        share = y.shape[0] // smp.rdp_size()
        rows = slice(smp.rdp_rank() * share, (smp.rdp_rank() + 1) * share)
        self.opt.zero_grad()
        out = self.train(self.model, tuple(t[rows] for t in x), y[rows])
        self.opt.step()
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict()`` (collective)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def held(self) -> list[str]:
        """The parameters this rank holds."""
        return sorted(n for n, _ in self.model.local_named_parameters())
