"""The plain reference run: the unpartitioned model trained in one process with a torch
optimizer, recording what a test compares smp-fx against.

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> batches = [(torch.ones(4, 2), torch.zeros(4, 1))] * 3
    >>> run = train_plain(model, opt, batches,
    ...                   lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    >>> len(run.losses), len(run.grads), sorted(run.params)
    (3, 3, ['bias', 'weight'])
    >>> run.losses[0] > run.losses[-1]
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

B = TypeVar("B")


@dataclass(frozen=True)
class PlainRun:
    """What the reference computed."""

    losses: list[float]
    """Each batch's loss."""
    grads: list[dict[str, torch.Tensor | None]]
    """Each batch's gradients right after its backward (accumulated since the last
    optimizer step), by ``named_parameters()`` name."""
    params: dict[str, torch.Tensor]
    """The parameters after the last step under every name, tied aliases included
    (``named_parameters(remove_duplicate=False)``), as the plain ``state_dict()`` has them."""
    state: dict[str, torch.Tensor]
    """The whole ``state_dict()`` after the last step (buffers too)."""
    norms: list[float]
    """Each optimizer step's gradient norm before clipping (with ``clip`` only)."""


def train_plain(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[B],
                loss_of: Callable[[nn.Module, B], torch.Tensor],
                accumulate: int = 1, clip: float | None = None) -> PlainRun:
    """Train ``model`` on ``batches`` in order: ``loss_of(model, batch).backward()``, and an
    optimizer step (then ``zero_grad``) after every ``accumulate`` batches, the gradients
    clipped to the norm ``clip`` first if given. Batches are drawn lazily, so a generator
    may draw random inputs between steps."""
    losses: list[float] = []
    norms: list[float] = []
    grads: list[dict[str, torch.Tensor | None]] = []
    for i, batch in enumerate(batches):
        loss = loss_of(model, batch)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: None if p.grad is None else p.grad.clone()
                      for n, p in model.named_parameters()})
        if (i + 1) % accumulate == 0:
            if clip is not None:
                norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            opt.zero_grad()
    return PlainRun(losses, grads, _detached(model.named_parameters(remove_duplicate=False)),
                    _detached(model.state_dict().items()), norms)


def _detached(named: Iterable[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named}
