"""The vocab-parallel cross entropy (``passes.tp_loss``) end to end on 2 gloo ranks (tp=2).

The GPT-2-style example with a vocabulary of 63 (wte / lm_head padded to 64 rows, 32 per
rank; every block marked whole) computes its loss in the forward, ``F.cross_entropy`` of
the tied head's logits with ``ignore_index=0`` (some targets are ignored). The graph fuses
the loss (the logits are never gathered: the spy below sees the op run on 32 columns), and
3 Adam steps equal one process: losses, full gradients, parameters and ``state_dict()``.

``prescaled_batch`` false: rank r feeds half r of the batch and its loss is that half's
mean, so the reference is the mean of the halves' losses (with ignored tokens the halves
count different tokens; one microbatch, as a microbatch's loss is its own mean); true:
both ranks the first half.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from passes import tp_loss
from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks
from tests.passes.test_tp_vocab import LossInside
from tests.smp_fx.dist.test_tensor_parallel import ADAM_EPS, GLOBAL_BATCH, STEPS, _gathered

VOCAB = 63
_ORIGINAL = tp_loss.tp_vocab_cross_entropy
WIDTHS: list[int] = []


def _spy(logits: torch.Tensor, *args: Any) -> torch.Tensor:
    """The fused op, recording the width of the logits it sees (this rank's columns)."""
    WIDTHS.append(int(logits.shape[-1]))
    return _ORIGINAL(logits, *args)


def _build() -> LossInside:
    import smp_fx as smp

    torch.manual_seed(0)
    model = LossInside(VOCAB)
    for module in (model.gpt.wte, model.gpt.lm_head, *model.gpt.h):
        smp.set_tensor_parallelism(module)
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, 16), generator=g),
             torch.randint(0, VOCAB // 4, (GLOBAL_BATCH, 16), generator=g))  # 0s: ignored
            for _ in range(STEPS)]


def _reference(prescaled: bool) -> tuple[list[list[float]], list[dict[str, torch.Tensor]],
                                         dict[str, torch.Tensor]]:
    model = _build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    share = GLOBAL_BATCH // 2
    losses, grads = [], []
    for x, y in _batches():
        halves = [model(x[:share], y[:share])] if prescaled else [
            model(x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]) for r in (0, 1)]
        (sum(halves) / len(halves)).backward()
        losses.append([h.item() for h in halves])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.state_dict().items()}


def _body(prescaled: bool) -> dict[str, Any]:
    import smp_fx as smp

    ref_losses, ref_grads, ref_params = _reference(prescaled)
    tp_loss.tp_vocab_cross_entropy = _spy  # type: ignore[assignment]
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True,
              "prescaled_batch": prescaled, "microbatches": 1})
    model = smp.DistributedModel(_build())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = model(x, y)
        model.backward(loss)
        return loss

    share = GLOBAL_BATCH // 2
    lo = 0 if prescaled else smp.tp_rank() * share
    bad = []
    for step, (x, y) in enumerate(_batches()):
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
    return {"bad": bad, "widths": sorted(set(WIDTHS)),
            "replicated": model.tp_plan.replicated}


@pytest.mark.parametrize("prescaled", [False, True])
def test_fused_vocab_parallel_loss_matches_single_process(prescaled: bool) -> None:
    results = run_ranks(_body, 2, prescaled, timeout=180, env={"SMP_FX_DEVICE_SPEC": "a100"})
    for rank, res in enumerate(results):
        assert isinstance(res, dict), f"rank {rank}: {res}"
        assert res["bad"] == [], f"rank {rank}: {res['bad']}"
        assert res["widths"] == [32]  # the fused loss ran, on this rank's 32 columns only
        assert res["replicated"] == ()
