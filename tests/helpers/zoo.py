"""The tiny Hugging Face models of ``examples/models/hf_zoo.py`` trained the plain way: the
reference the tensor-parallel tests compare against.

``batches`` is the same seeded data for the reference and the distributed run;
``sgd_reference`` (``reference``: any optimizer) trains the unmarked model on it in this
process and returns each step's gradients and the final state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from examples.models import hf_zoo

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def batches(arch: str, batch: int, steps: int) -> list[Batch]:
    torch.manual_seed(1234)
    return [(hf_zoo.inputs(arch, batch), hf_zoo.targets(arch, batch)) for _ in range(steps)]


Optimizer = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def sgd_reference(arch: str, batch: int, steps: int, lr: float
                  ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process, the plain model, plain SGD: per-step gradients and the final state
    dict."""
    return reference(arch, batch, steps, lambda ps: torch.optim.SGD(ps, lr=lr))


def reference(arch: str, batch: int, steps: int, optimizer: Optimizer,
              attention: str = "eager"
              ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """One process, the plain model (``attention``: ``hf_zoo.build``'s), trained by
    ``optimizer(parameters)``: per-step gradients and the final state dict."""
    model = hf_zoo.build(arch, marked=False, attention=attention)
    opt = optimizer(model.parameters())
    grads = []
    for x, y in batches(arch, batch, steps):
        opt.zero_grad()
        hf_zoo.loss_fn(model(*x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return grads, {k: v.clone() for k, v in model.state_dict().items()}
