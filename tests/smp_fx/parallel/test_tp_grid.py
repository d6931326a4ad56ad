"""pp=2 x tp=2 x rdp=2 on 8 gloo ranks: placements, schedules, microbatches, batch modes.

One spawn of 8 processes runs a covering set of configurations one after another (one
default group; ``smp.init`` / ``state._reset`` per configuration). Each checks:

* the rank -> (rdp, pp, tp) mapping of its ``placement_strategy`` against SMP's documented
  rule (the right-most letter varies fastest over the global ranks; ``cluster`` = "DPT",
  ``spread`` = "TPD"; the page's own "DPT" and "PTD" tables are the test's examples);
* 3 Adam steps of the tensor-parallel MLP (a marked column -> GELU -> row pair and a lone
  ``DistributedLinear`` head, cut into 2 stages) against one process training the plain
  model on the global batch: every local gradient (shards gathered over tp) at every step
  and every parameter after the steps, fp32, 1e-5. Every placement, ``prescaled_batch``
  both ways.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from tests.helpers.compare import mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.reference import train_plain
from tests.smp_fx.parallel.test_tensor_parallel import MLP, _gathered

GLOBAL_BATCH, STEPS = 16, 3
LR = 1e-3  # Adam at 1e-2 turns the gradients' 1e-7 summation-order noise into 1.7e-5
SIZES = {"D": 2, "P": 2, "T": 2}
# (placement, pipeline, microbatches, prescaled_batch): every placement (cluster = DPT,
# spread = TPD, and the other four orders) with prescaled_batch both ways, each pipeline
# and microbatch count several times (``ddp`` is on: tp > 1 requires it, as in SMP)
PLACEMENTS = ("cluster", "spread", "DTP", "PDT", "PTD", "TDP")
CONFIGS = tuple((placement, ("simple", "interleaved")[(i + k) % 2], (2, 4)[i % 2], prescaled)
                for i, placement in enumerate(PLACEMENTS) for k, prescaled in enumerate(
                    (False, True)))


def expected_ranks(placement: str, rank: int) -> dict[str, int]:
    """(rdp, pp, tp) of ``rank`` by SMP's documented rule."""
    order = {"cluster": "DPT", "spread": "TPD"}.get(placement, placement)
    out, rest = {}, rank
    for letter in reversed(order):
        out[letter], rest = rest % SIZES[letter], rest // SIZES[letter]
    return {"rdp": out["D"], "pp": out["P"], "tp": out["T"]}


def test_the_seed_page_tables() -> None:
    dpt = [expected_ranks("DPT", r) for r in range(8)]
    assert [(d["rdp"], d["pp"], d["tp"]) for d in dpt] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    ptd = [expected_ranks("PTD", r) for r in range(8)]
    assert [(d["rdp"], d["pp"], d["tp"]) for d in ptd] == [
        (0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1)]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(GLOBAL_BATCH, 8, generator=g),
             torch.randint(0, 6, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]


def _reference() -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    run = train_plain(model, opt, _batches(), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    return run.grads, run.params


def init_grid(placement: str, pipeline: str, m: int, prescaled: bool) -> list[str]:
    """``smp.init`` at pp 2 x tp 2 x rdp 2 with ddp; a mismatch if this rank's (rdp, pp,
    tp) is not where SMP's documented rule puts it (empty when it is)."""
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
              "placement_strategy": placement, "pipeline": pipeline, "microbatches": m,
              "prescaled_batch": prescaled})
    want = expected_ranks(placement, dist.get_rank())
    got = {"rdp": smp.rdp_rank(), "pp": smp.pp_rank(), "tp": smp.tp_rank()}
    return [] if got == want else [f"ranks {got} != {want}"]


def _config(placement: str, pipeline: str, m: int, prescaled: bool) -> list[str]:
    import smp_fx as smp
    from smp_fx.world import state

    state._reset()
    tag = f"{placement}/{pipeline}/m{m}/prescaled={prescaled}"
    wrong = init_grid(placement, pipeline, m, prescaled)
    if wrong:
        return [f"{tag}: {wrong[0]}"]
    torch.manual_seed(0)
    model = smp.DistributedModel(MLP())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    # prescaled: the tp ranks of a group share the rdp shard; else each dp rank its own
    parts, index = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(),
                                                                        smp.dp_rank())
    share = GLOBAL_BATCH // parts
    ref_grads, ref_params = _reference()
    bad: list[str] = []
    for step, (x, y) in enumerate(_batches()):
        train_step(model, x[index * share:(index + 1) * share], y[index * share:
                                                                (index + 1) * share])
        got_grads = _gathered(model, {n: p.grad for n, p in model.local_named_parameters()})
        bad += [f"{tag}: grad {n} step {step}"
                for n in mismatched(got_grads, ref_grads[step], atol=1e-5, rtol=1e-5)]
        opt.step()
        opt.zero_grad()
    params = _gathered(model, {n: p.detach() for n, p in model.local_named_parameters()})
    bad += [f"{tag}: param {n} {(params[n] - ref_params[n]).abs().max().item():.2e}"
            for n in mismatched(params, ref_params, atol=1e-5, rtol=1e-5)]
    if not model.tp_plan.sharded:
        bad.append(f"{tag}: nothing sharded")
    return bad


def _body() -> list[str]:
    dist.init_process_group("gloo")
    bad: list[str] = []
    for config in CONFIGS:
        bad += _config(*config)
    return bad


@pytest.mark.multiproc
@pytest.mark.usefixtures("check_order")  # NCCL's ordering rule too (docs/runtime.md)
def test_pp2_tp2_rdp2_on_8_ranks_equals_one_process() -> None:
    results = run_ranks(_body, 8, timeout=400)
    assert all(r == [] for r in results), [r for r in results if r]
