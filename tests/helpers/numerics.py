"""Train a model with smp-fx and as plain PyTorch side by side, and compare.

``Pair`` holds the reference (the unpartitioned model in one process, on ``device``) and an
smp-fx ``DistributedModel`` starting from the same weights; ``compare`` trains both and asserts
the loss, every local gradient after each step, and the parameters and buffers after the
last optimizer step agree (fp32, atol 1e-5). The reference runs the same microbatches one
after another (loss / m backward each), which is what SMP's pipeline computes; for models
without batch statistics it equals the full-batch gradient. ``init`` (re-)initialises smp,
since tests switch configurations freely.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import smp_fx as smp
from smp_fx.world import state
from tests.helpers.models import example


def init(pp: int, m: int, pipeline: str, **extra: Any) -> None:
    """(Re-)initialise smp with this configuration."""
    state._reset()
    smp.init({"pipeline_parallel_degree": pp, "microbatches": m, "pipeline": pipeline,
              "active_microbatches": max(m, 1), **extra})


def train_step_of(ex: Any) -> Any:
    """The ``smp.step`` function of an example model: forward, its loss, backward;
    returns (outputs, loss)."""

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = model(x)
        loss = ex.loss_fn(out, y)
        model.backward(loss)
        return out, loss

    return train_step


def twin_models(name: str) -> tuple[Any, torch.nn.Module, smp.DistributedModel]:
    """(example module, plain model, DistributedModel of a copy with the same weights)."""
    ex = example(name)
    torch.manual_seed(0)
    ref = ex.build_model()
    model = ex.build_model()
    model.load_state_dict(ref.state_dict())
    return ex, ref, smp.DistributedModel(model)


class Pair:
    """A reference model and an smp-fx DistributedModel starting from the same weights."""

    def __init__(self, name: str, batch: int = 8, seed: int = 0,
                 model_kwargs: dict[str, Any] | None = None,
                 device: str = "cpu") -> None:
        self.ex = example(name)
        torch.manual_seed(seed)
        self.ref = self.ex.build_model(**(model_kwargs or {}))
        model = self.ex.build_model(**(model_kwargs or {}))
        model.load_state_dict(self.ref.state_dict())
        self.initial = {k: v.clone() for k, v in self.ref.state_dict().items()}
        self.dm = smp.DistributedModel(model)
        torch.manual_seed(seed + 1)
        self.x = tuple(x.to(device) for x in self.ex.example_inputs(batch))
        self.y = self.ex.example_targets(batch).to(device)
        self.ref.to(device)  # the smp-fx model is placed by its runtime

        self.train_step = train_step_of(self.ex)

    def reset(self) -> None:
        """Both models back to the initial weights, grads cleared."""
        with torch.no_grad():
            self.ref.load_state_dict(self.initial)
            self.dm.module.load_state_dict(self.initial)
        for p in list(self.ref.parameters()) + list(self.dm.module.parameters()):
            p.grad = None

    def ref_step(self, m: int) -> float:
        """One reference step over ``m`` microbatches (gradients accumulate); its loss."""
        total = 0.0
        for xm, ym in zip(self.x[0].chunk(m), self.y.chunk(m)):
            loss = self.ex.loss_fn(self.ref(xm), ym)
            (loss / m).backward()
            total += loss.item() / m
        return total

    def compare(self, steps: int, m: int, lr: float = 0.05,
                batches: list[tuple[tuple[Any, ...], torch.Tensor]] | None = None) -> float:
        """Train ``steps`` steps both ways; assert loss, grads, params, buffers agree.
        ``batches``: step i trains on ``batches[i]`` (inputs, targets) instead of the
        pair's one batch. Returns the largest difference seen in the loss and the
        gradients."""
        self.reset()
        ref_opt = torch.optim.SGD(self.ref.parameters(), lr=lr, momentum=0.9)
        opt = smp.DistributedOptimizer(torch.optim.SGD(self.dm.module.parameters(), lr=lr,
                                                       momentum=0.9))
        if self.dm.partitioned:
            opt.bind(self.dm.parallelized.binding())
        worst = 0.0
        ref_params = dict(self.ref.named_parameters(remove_duplicate=False))
        for i in range(steps):
            if batches is not None:
                self.x, self.y = batches[i]
            ref_opt.zero_grad()
            opt.zero_grad()
            ref_loss = self.ref_step(m)
            _, loss_mb = self.train_step(self.dm, *self.x, self.y)
            loss = loss_mb.reduce_mean().item()
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
            worst = max(worst, abs(loss - ref_loss))
            for name, p in self.dm.local_named_parameters():
                ref = ref_params[name]
                assert p.grad is not None and ref.grad is not None, name
                grad = p.grad.to(ref.grad.device)  # a stage on another GPU keeps it there
                torch.testing.assert_close(grad, ref.grad, atol=1e-5, rtol=0,
                                           msg=_naming(f"gradient of {name}"))
                worst = max(worst, (grad - ref.grad).abs().max().item())
            ref_opt.step()
            opt.step()
        ref_state = {**ref_params, **dict(self.ref.named_buffers(remove_duplicate=False))}
        for name, t in list(self.dm.local_named_parameters()) + \
                list(self.dm.local_named_buffers()):
            if name not in ref_state and "lifted_tensor" in name:
                continue  # a constant torch.export lifted into a buffer (torch 2.11)
            ref_t = ref_state[name].detach()
            torch.testing.assert_close(t.detach().to(ref_t.device), ref_t, atol=1e-5, rtol=0,
                                       msg=_naming(name))
        return worst


def _naming(name: str) -> Callable[[str], str]:
    """An ``assert_close`` message that names the tensor and keeps the differences."""
    return lambda detail: f"{name}: {detail}"
