"""Every schedule equals one process on Hugging Face models built from configs, across
processes: the numerics grid of ``test_schedules`` on real models' boundaries.

Llama, T5 (its embedding tied to its head), GPT-2, BERT, and the vision models ViT (a class
token and position embeddings) and Swin (shifted windows, patch merging)
(``examples/models/hf_zoo.py``) at pp 2 on 2 gloo processes, each schedule at v = 1 and 2 on
one of them and every model under a chunked one: many tensors, integer and boolean tensors
and plain values cross between the chunks of one pair of ranks, some from one chunk to both
chunks of the other rank. A model of the project's own returns, besides its logits, a tensor
off the loss's path made on the first stage (a cache), an integer and a boolean tensor: they
get no gradient. One spawn runs every case in turn; 3 Adam steps, every gradient after every
step and the full ``state_dict()`` after them within 1e-5 of the plain model trained in one
process on the global batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from examples.models import hf_zoo
from tests.helpers import zoo
from tests.helpers.compare import mismatched, state_dict_mismatches
from tests.helpers.dist import run_ranks
from tests.helpers.reference import train_plain

BATCH, STEPS, MICROBATCHES = 4, 3, 2
TOL = {"atol": 1e-5, "rtol": 1e-5}
# (model, pipeline, virtual_pipeline_degree): every schedule x v on some model, every model
# under a chunked schedule
CASES = (("llama", "zbv", 2), ("llama", "simple", 1),
         ("t5", "interleaved", 2), ("t5", "zero_bubble", 1),
         ("gpt2", "zero_bubble", 2), ("gpt2", "interleaved", 1),
         ("bert", "simple", 2),
         ("vit", "interleaved", 2), ("swin", "zbv", 2),
         ("cache", "interleaved", 2))


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)  # eps: near-zero gradients stay small


class Cached(nn.Module):
    """Logits, and what a Hugging Face model returns beside them: a tensor made early
    (a cache) that requires grad, an integer and a boolean tensor, none on the loss's path."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.blocks[0](x))
        cache = h * 2
        for block in self.blocks[1:]:
            h = torch.tanh(block(h))
        logits = self.head(h)
        return logits, cache, logits.argmax(-1), h.sum(-1) > 0


def _cached_model() -> nn.Module:
    torch.manual_seed(0)
    return Cached()


def _cached_batches() -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [((torch.randn(BATCH, 8, generator=g),), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _cached_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0], y)


def _references(path: Path) -> None:
    refs = {arch: zoo.reference(arch, BATCH, STEPS, _adam)
            for arch in sorted({a for a, _, _ in CASES if a != "cache"})}
    model = _cached_model()
    run = train_plain(model, _adam(model.parameters()), _cached_batches(),
                      lambda m, b: _cached_loss(m(*b[0]), b[1]))
    refs["cache"] = ([{n: g for n, g in s.items() if g is not None} for s in run.grads],
                     run.state)
    torch.save(refs, path)


def _case(arch: str, pipeline: str, v: int, ref: Any) -> list[str]:
    import smp_fx as smp
    from smp_fx.world import state

    state._reset()
    smp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES,
              "pipeline": pipeline, "virtual_pipeline_degree": v})
    own = arch == "cache"
    model = smp.DistributedModel(_cached_model() if own else hf_zoo.build(arch, marked=False))
    opt = smp.DistributedOptimizer(_adam(model.parameters()))
    loss_fn = _cached_loss if own else hf_zoo.loss_fn

    @smp.step
    def train_step(model: Any, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> Any:
        out = model(*x)
        loss = loss_fn(out, y)
        model.backward(loss)
        return out

    tag = f"{arch} {pipeline} v={v}"
    ref_grads, ref_state = ref
    bad: list[str] = []
    for step, (x, y) in enumerate(_cached_batches() if own else zoo.batches(arch, BATCH, STEPS)):
        opt.zero_grad()
        out = train_step(model, x, y)
        if own and any(t.requires_grad for t in out[1].outputs):
            bad.append(f"{tag}: the cache handed back requires grad")
        grads = {n: p.grad for n, p in model.local_named_parameters() if p.grad is not None}
        if grads or any(True for _ in model.local_named_parameters()):  # a cut may leave none
            bad += [f"{tag}: grad {n} step {step}"
                    for n in mismatched(grads, ref_grads[step], **TOL)]
        opt.step()
    return bad + [f"{tag}: {m}" for m in state_dict_mismatches(model.state_dict(), ref_state,
                                                                **TOL)]


def _all_cases(path: str) -> list[str]:
    from smp_fx.world import state

    dist.init_process_group("gloo")
    refs = torch.load(path, weights_only=True)
    try:
        return [b for arch, pipeline, v in CASES for b in _case(arch, pipeline, v, refs[arch])]
    finally:
        state._reset()


@pytest.mark.multiproc
def test_every_schedule_on_hugging_face_models_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "references.pt"
    _references(path)
    assert run_ranks(_all_cases, 2, str(path), timeout=600) == [[], []]
