"""A model whose forward computes its loss, trained at tp=2 (2 gloo ranks) against one process.

``compare_at_tp2(build, batches, prescaled)`` runs on each rank (``run_ranks``; ``run_at_tp2``
starts both ranks and checks what every such test requires): the plain
model ``build()`` trains on ``batches()`` as the reference, then the ``DistributedModel``
of another ``build()`` does, 3 Adam steps, and every loss, full gradient and the final
``state_dict()`` are compared. The vocab-parallel cross entropy is spied on: ``widths``
are the logits' widths it saw (this rank's columns), so a test can tell the loss was fused.

``prescaled_batch`` false: rank r feeds half r of the batch and its loss is that half's
mean, so the reference is the mean of the halves' losses (one microbatch, as a
microbatch's loss is its own mean); true: both ranks the first half.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from passes.tensor_parallel import loss as tp_loss
from tests.helpers.compare import mismatched
from tests.helpers.reference import train_plain
from tests.smp_fx.parallel.test_tensor_parallel import ADAM_EPS, GLOBAL_BATCH, _gathered

Batches = list[tuple[torch.Tensor, torch.Tensor]]
_ORIGINAL = tp_loss.tp_vocab_cross_entropy
WIDTHS: list[int] = []


def _spy(logits: torch.Tensor, *args: Any) -> torch.Tensor:
    """The fused op, recording the width of the logits it sees (this rank's columns)."""
    WIDTHS.append(int(logits.shape[-1]))
    return _ORIGINAL(logits, *args)


def _reference(build: Callable[[], nn.Module], batches: Callable[[], Batches], prescaled: bool
               ) -> tuple[list[list[float]], list[dict[str, torch.Tensor]],
                          dict[str, torch.Tensor]]:
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    share = GLOBAL_BATCH // 2
    losses: list[list[float]] = []

    def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        halves = [model(x[:share], y[:share])] if prescaled else [
            model(x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]) for r in (0, 1)]
        losses.append([h.item() for h in halves])
        return sum(halves) / len(halves)

    run = train_plain(model, opt, batches(), loss_of)
    return losses, run.grads, run.state


def compare_at_tp2(build: Callable[[], nn.Module], batches: Callable[[], Batches],
                   prescaled: bool) -> dict[str, Any]:
    """On one of 2 ranks: what differs from one process (``bad``), the spied widths, and
    the tp plan's replicated regions and number of sharded tensors."""
    import smp_fx as smp

    ref_losses, ref_grads, ref_params = _reference(build, batches, prescaled)
    tp_loss.tp_vocab_cross_entropy = _spy  # type: ignore[assignment]
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True,
              "prescaled_batch": prescaled, "microbatches": 1})
    model = smp.DistributedModel(build())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = model(x, y)
        model.backward(loss)
        return loss

    share = GLOBAL_BATCH // 2
    lo = 0 if prescaled else smp.tp_rank() * share
    bad = []
    for step, (x, y) in enumerate(batches()):
        loss = train_step(model, x[lo:lo + share], y[lo:lo + share]).reduce_mean()
        want = ref_losses[step][0 if prescaled else smp.tp_rank()]
        if abs(loss.item() - want) > 1e-5:
            bad.append(f"loss step {step}: {loss.item()} != {want}")
        got = _gathered(model, {n: p.grad for n, p in model.local_named_parameters()})
        bad += [f"grad {n} step {step}" for n in mismatched(got, ref_grads[step],
                                                            atol=1e-5, rtol=1e-5)]
        opt.step()
        opt.zero_grad()
    # tiny gradients (the key bias's) that Adam normalises to full steps: see
    # test_tensor_parallel; the parameters agree to 1e-4
    bad += [f"state_dict {n}" for n in mismatched(model.state_dict(), ref_params,
                                                  atol=1e-4, rtol=1e-4)]
    return {"bad": bad, "widths": sorted(set(WIDTHS)), "replicated": model.tp_plan.replicated,
            "sharded": len(model.tp_plan.sharded)}


Case = tuple[Callable[[], nn.Module], Callable[[], Batches], bool]
"""What ``compare_at_tp2`` takes: (build, batches, prescaled)."""


def compare_each_at_tp2(cases: dict[str, Case]) -> dict[str, Any]:
    """``compare_at_tp2`` for every case in turn on one gloo world, each under its own
    ``smp.init`` and record of widths; a case that raises is reported as its traceback."""
    from tests.helpers.dist import each_on_one_world

    def fresh(case: Case) -> Callable[[], Any]:
        def run() -> Any:
            WIDTHS.clear()
            return compare_at_tp2(*case)
        return run

    return each_on_one_world({name: fresh(case) for name, case in cases.items()}, str)


def run_at_tp2(build: Callable[[], nn.Module], batches: Callable[[], Batches],
               prescaled: bool) -> list[dict[str, Any]]:
    """``compare_at_tp2`` on 2 gloo ranks (plans priced with the ``a100`` spec); each rank's
    result, checked for what every such test requires: nothing differs from one process
    and no region stayed replicated."""
    return checked("", run_each_at_tp2({"": (build, batches, prescaled)})[""])


def run_each_at_tp2(cases: dict[str, Case], timeout: float = 180) -> dict[str, list[Any]]:
    """``compare_at_tp2`` of every case, all in one spawn of 2 ranks: each case's results
    by rank, unchecked (``checked`` checks one case)."""
    from tests.helpers.dist import run_ranks

    results = run_ranks(compare_each_at_tp2, 2, cases, timeout=timeout,
                        env={"SMP_FX_DEVICE_SPEC": "a100"})
    return {name: [r[name] for r in results] for name in cases}


def checked(name: str, results: list[Any]) -> list[dict[str, Any]]:
    """Case ``name``'s results by rank, checked for what every such test requires."""
    for rank, res in enumerate(results):
        assert isinstance(res, dict), f"{name} rank {rank}: {res}"
        assert res["bad"] == [], f"{name} rank {rank}: {res['bad']}"
        assert res["replicated"] == (), f"{name} rank {rank}: {res['replicated']}"
    return results
