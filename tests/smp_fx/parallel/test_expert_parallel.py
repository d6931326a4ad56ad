"""Expert parallelism (``expert_parallel_degree``) against the one-process model.

The multi-process test: one spawn of 2 gloo ranks (dp 2, ep 2) trains the four MoE
families of ``examples/models/moe_zoo.py`` (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3 with its
shared expert) for 3 steps with SGD and with Adam (eps 1e-6), each rank on its half of the
global batch; every local gradient at every step (an expert slice against its experts'
rows of the one-process gradient) and the full ``state_dict()`` after them match the plain
model trained on the whole batch in this process (1e-5). Each rank holds half of the
experts' parameter bytes and all of the rest, and every MoE block is expert-parallel.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from examples.models import moe_zoo
from tests.helpers.compare import mismatched, state_dict_mismatches
from tests.helpers.dist import run_ranks

GLOBAL_BATCH, STEPS, LR = 4, 3, 0.05
TOL = {"atol": 1e-5, "rtol": 1e-5}
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=LR),
              "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, eps=1e-6)}
ARCHS = tuple(moe_zoo.ARCHITECTURES)
CE = torch.nn.functional.cross_entropy


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1234)
    return [(moe_zoo.inputs(GLOBAL_BATCH)[0], moe_zoo.targets(GLOBAL_BATCH))
            for _ in range(STEPS)]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return CE(logits.flatten(0, -2), y.flatten())


def _reference(arch: str, opt_name: str) -> tuple[list[dict[str, torch.Tensor]],
                                                  dict[str, torch.Tensor]]:
    model = moe_zoo.build(arch)
    opt = OPTIMIZERS[opt_name](model.parameters())
    grads = []
    for x, y in _batches():
        opt.zero_grad()
        _loss(model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return grads, {k: v.clone() for k, v in model.state_dict().items()}


def _expert_rows(want: dict[str, torch.Tensor], names: frozenset[str], ep: int,
                 rank: int) -> dict[str, torch.Tensor]:
    """``want`` with each expert tensor cut to the rows ep rank ``rank`` holds."""
    return {n: (t.chunk(ep)[rank] if n in names else t) for n, t in want.items()}


def _train(arch: str, opt_name: str, ref: Any) -> dict[str, Any]:
    import smp_fx as smp
    from smp_fx.world import state as smp_state

    ref_grads, ref_state = ref
    smp_state._reset()
    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "expert_parallel_degree": 2})
    plain = moe_zoo.build(arch)
    model = smp.DistributedModel(moe_zoo.build(arch))
    opt = smp.DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = _loss(model(x), y)
        model.backward(loss)
        return loss

    share = GLOBAL_BATCH // smp.dp_size()
    sl = slice(smp.dp_rank() * share, (smp.dp_rank() + 1) * share)
    names, ep, rank = model.expert_names, smp.ep_size(), smp.ep_rank()
    bad = []
    for step, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        train_step(model, x[sl], y[sl])
        grads = {n: p.grad for n, p in model.local_named_parameters() if p.grad is not None}
        want = _expert_rows(ref_grads[step], names, ep, rank)
        bad += [f"{opt_name} grad {n} step {step}" for n in mismatched(grads, want, **TOL)]
        opt.step()
    bad += [f"{opt_name} {m}" for m in state_dict_mismatches(model.state_dict(), ref_state,
                                                             **TOL)]
    local = dict(model.local_named_parameters())
    expert_bytes = sum(p.numel() * p.element_size() for n, p in local.items() if n in names)
    plain_expert = sum(p.numel() * p.element_size() for n, p in plain.named_parameters()
                       if n in names)
    rest = sum(p.numel() * p.element_size() for n, p in local.items() if n not in names)
    plain_rest = sum(p.numel() * p.element_size() for n, p in plain.named_parameters()
                     if n not in names)
    return {"bad": bad, "ep": (ep, rank), "coverage": [b.line() for b in model.ep_coverage],
            "bytes": (expert_bytes, plain_expert, rest, plain_rest)}


def _all(path: str) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    refs = torch.load(path, weights_only=True)
    return {f"{arch}/{o}": _train(arch, o, refs[f"{arch}/{o}"])
            for arch in ARCHS for o in OPTIMIZERS}


@pytest.mark.multiproc
def test_ep2_matches_single_process_model(tmp_path: Any) -> None:
    path = str(tmp_path / "reference.pt")
    torch.save({f"{a}/{o}": _reference(a, o) for a in ARCHS for o in OPTIMIZERS}, path)
    results = run_ranks(_all, 2, path, timeout=600)
    for case in results[0]:
        got = [r[case] for r in results]
        assert [g["bad"] for g in got] == [[], []], (case, [g["bad"] for g in got])
        assert [g["ep"] for g in got] == [(2, 0), (2, 1)], case
        lines = got[0]["coverage"]
        assert len(lines) == 2 and all("expert-parallel, 2 of 4" in line
                                       for line in lines), (case, lines)
        for g in got:
            expert, plain_expert, rest, plain_rest = g["bytes"]
            assert plain_expert > 0 and expert * 2 == plain_expert, (case, g["bytes"])
            assert rest == plain_rest, (case, g["bytes"])
