"""A manual partition whose modules come back to an earlier rank runs, as SMP ran it.

AWS's GPT-2 example (``--manual_partition 1``) pins only the transformer layers with
``smp.set_partition``; the final norm and the head fall to ``default_partition`` 0 and run
after rank 1's layers. The plan cuts such pins into chunks in model order (here chunks on
ranks 0, 1, 0; ``passes.manual_chunks``), list-scheduled, and training equals one process
on the global batch: the loss and gradients every step and parameters after 3 Adam steps
within 1e-5, in one process and across 2 processes. The model ties its head to its
embedding, both on rank 0 (two chunks of one rank share the parameter).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import smp_fx as smp
from cost_model.errors import SMPPartitionError
from smp_fx.world import state
from tests.helpers.dist import run_ranks

VOCAB, WIDTH, LAYERS = 32, 16, 4
CASES = (("simple", 1), ("interleaved", 1), ("zero_bubble", 1), ("interleaved", 2),
         ("zbv", 2))
"""At v = 2 rank 1's one run is cut in two: chunks on ranks 0, 1, 1, 0 (ZB-V's V)."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class TinyLM(nn.Module):
    """GPT-2's outline: embedding, layers ``h``, ``ln_f``, a head tied to the embedding."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def _model(pp: int, layers: int = LAYERS, pin: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = TinyLM(layers)
    if pin:  # the notebook's manual partition: the layers only
        for i, block in enumerate(model.h):
            smp.set_partition(block, i * pp // layers)
    return model


def _case(pp: int, name: str, v: int, layers: int = LAYERS) -> tuple[int, ...]:
    """Train both ways (every mismatch raises); the plan's placement."""
    state._reset()
    smp.init({"pipeline_parallel_degree": pp, "microbatches": 4, "pipeline": name,
              "virtual_pipeline_degree": v, "auto_partition": False,
              "default_partition": 0})
    ref, model = _model(pp, layers, pin=False), smp.DistributedModel(_model(pp, layers))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        model.backward(loss)
        return loss

    g = torch.Generator().manual_seed(1)
    tag = f"pp={pp} {name} v={v}"
    for step in range(3):
        ids = torch.randint(0, VOCAB, (8, 6), generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = train_step(model, ids).reduce_mean()  # the loss every rank reports
        logits = ref(ids)
        ref_loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=0, atol=1e-5)
        want = dict(ref.named_parameters())
        for n, p in model.local_named_parameters():
            torch.testing.assert_close(p.grad, want[n].grad, rtol=0, atol=1e-5,
                                       msg=lambda m, n=n, k=step: f"{tag} grad {n} step {k}: {m}")
        opt.step()
        ref_opt.step()
    want = dict(ref.named_parameters())
    for n, p in model.local_named_parameters():
        torch.testing.assert_close(p.detach(), want[n].detach(), rtol=0, atol=1e-5,
                                   msg=lambda m, n=n: f"{tag} param {n}: {m}")
    assert model.plan is not None
    return model.plan.rank_of


@pytest.mark.parametrize(("name", "v"), CASES)
def test_in_one_process(name: str, v: int) -> None:
    try:
        placement = _case(2, name, v)
    finally:
        state._reset()
    assert placement == ((0, 1, 0) if v == 1 else (0, 1, 1, 0))


def test_four_ranks_and_back_to_the_first() -> None:
    try:
        placement = _case(4, "interleaved", 1, layers=8)
    finally:
        state._reset()
    assert placement == (0, 1, 2, 3, 0)


def test_a_rank_without_modules_is_named() -> None:
    # 3 ranks, the layers on 0 and 2 only: rank 1 would hold no chunk
    state._reset()
    try:
        smp.init({"pipeline_parallel_degree": 3, "microbatches": 2, "auto_partition": False,
                  "default_partition": 0})
        model = TinyLM(2)
        smp.set_partition(model.h[1], 2)
        dm = smp.DistributedModel(model)

        @smp.step
        def run(m: Any, ids: torch.Tensor) -> torch.Tensor:
            out = m(ids).sum()
            m.backward(out)
            return out

        with pytest.raises(SMPPartitionError, match=r"rank 1: no module pinned.*"
                           r"pin a module to partition 1"):
            run(dm, torch.zeros(2, 4, dtype=torch.long))
    finally:
        state._reset()


def _all_cases() -> list[tuple[int, ...]]:
    dist.init_process_group("gloo")
    try:
        return [_case(2, name, v) for name, v in CASES]
    finally:
        state._reset()


@pytest.mark.multiproc
def test_across_processes() -> None:
    want = [(0, 1, 0)] * 3 + [(0, 1, 1, 0)] * 2
    assert run_ranks(_all_cases, 2, timeout=240) == [want, want]
