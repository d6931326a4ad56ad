"""A Hugging Face causal LM trained with ``labels=`` at tp=2 (2 gloo ranks), its loss fused.

The tiny HF GPT-2 (torch.export graph) with its tied ``lm_head`` and ``transformer.wte``
marked (``pair``), or the whole model marked (``whole``: attention by heads and the MLPs
too; before, the loss inside the region replicated all of it). transformers computes the
loss in the forward (``logits.float()``, labels shifted, ``cross_entropy(ignore_index=
-100)``; every third label is -100), which ``passes.tp_loss`` fuses, so the logits are
never gathered: the spy sees the op run on 64 columns (vocabulary 128, or 127, odd like
GPT-2's 50257, padded to 128). 3 Adam steps equal one process: losses, full gradients,
``state_dict()``.

``prescaled_batch`` false: rank r feeds half r of the batch and its loss is the mean over
that half's labels not ignored, so the reference is the mean of the halves' losses (one
microbatch); true: both ranks the first half.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from passes import tp_loss
from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks
from tests.passes.test_tp_vocab import HFLoss, hf_labels
from tests.smp_fx.dist.test_tensor_parallel import ADAM_EPS, GLOBAL_BATCH, STEPS, _gathered

_ORIGINAL = tp_loss.tp_vocab_cross_entropy
WIDTHS: list[int] = []


def _spy(logits: torch.Tensor, *args: Any) -> torch.Tensor:
    """The fused op, recording the width of the logits it sees (this rank's columns)."""
    WIDTHS.append(int(logits.shape[-1]))
    return _ORIGINAL(logits, *args)


def _build(marking: str, vocab: int) -> HFLoss:
    import smp_fx as smp

    torch.manual_seed(0)
    model = HFLoss(vocab=vocab)
    for module in ((model.model,) if marking == "whole" else
                   (model.model.transformer.wte, model.model.lm_head)):
        smp.set_tensor_parallelism(module)
    return model


def _batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, vocab, (GLOBAL_BATCH, 16), generator=g) for _ in range(STEPS)]
    return [(x, hf_labels(x)) for x in ids]


def _reference(prescaled: bool, marking: str, vocab: int
               ) -> tuple[list[list[float]], list[dict[str, torch.Tensor]],
                          dict[str, torch.Tensor]]:
    model = _build(marking, vocab)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    share = GLOBAL_BATCH // 2
    losses, grads = [], []
    for x, y in _batches(vocab):
        halves = [model(x[:share], y[:share])] if prescaled else [
            model(x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]) for r in (0, 1)]
        (sum(halves) / len(halves)).backward()
        losses.append([h.item() for h in halves])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.state_dict().items()}


def _body(prescaled: bool, marking: str, vocab: int) -> dict[str, Any]:
    import smp_fx as smp

    ref_losses, ref_grads, ref_params = _reference(prescaled, marking, vocab)
    tp_loss.tp_vocab_cross_entropy = _spy  # type: ignore[assignment]
    smp.init({"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2, "ddp": True,
              "prescaled_batch": prescaled, "microbatches": 1})
    model = smp.DistributedModel(_build(marking, vocab))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, eps=ADAM_EPS))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = model(x, y)
        model.backward(loss)
        return loss

    share = GLOBAL_BATCH // 2
    lo = 0 if prescaled else smp.tp_rank() * share
    bad = []
    for step, (x, y) in enumerate(_batches(vocab)):
        loss = train_step(model, x[lo:lo + share], y[lo:lo + share]).reduce_mean()
        want = ref_losses[step][0 if prescaled else smp.tp_rank()]
        if abs(loss.item() - want) > 1e-5:
            bad.append(f"loss step {step}: {loss.item()} != {want}")
        got = _gathered(model, {n: p.grad for n, p in model.local_named_parameters()})
        bad += [f"grad {n} step {step}" for n in mismatched(got, ref_grads[step],
                                                            atol=1e-5, rtol=1e-5)]
        opt.step()
        opt.zero_grad()
    bad += [f"state_dict {n}" for n in mismatched(model.state_dict(), ref_params,
                                                  atol=1e-4, rtol=1e-4)]
    return {"bad": bad, "widths": sorted(set(WIDTHS)), "replicated": model.tp_plan.replicated,
            "sharded": len(model.tp_plan.sharded)}


@pytest.mark.parametrize(("marking", "vocab", "prescaled"), [
    ("pair", 128, False), ("pair", 128, True), ("whole", 128, False), ("whole", 128, True),
    ("pair", 127, False), ("pair", 127, True)])
def test_hf_causal_lm_loss_with_labels_matches_single_process(marking: str, vocab: int,
                                                              prescaled: bool) -> None:
    results = run_ranks(_body, 2, prescaled, marking, vocab, timeout=180,
                        env={"SMP_FX_DEVICE_SPEC": "a100"})
    for rank, res in enumerate(results):
        assert isinstance(res, dict), f"rank {rank}: {res}"
        assert res["bad"] == [], f"rank {rank}: {res['bad']}"
        assert res["widths"] == [64]  # the fused loss ran, on this rank's 64 columns only
        assert res["replicated"] == ()
        assert res["sharded"] == (15 if marking == "whole" else 2)  # whole: wpe, 2 blocks too
