"""pp=2 x tp=2 x rdp=2 on 8 gloo ranks with Hugging Face architectures marked whole.

One spawn of 8 ranks runs every model in turn (the plain models trained on the global
batch in the test process and shipped to the ranks), for five structures of
``examples/models/hf_zoo.py``: an encoder-decoder (BART: cross-attention, the shared
embedding read by both stacks across the stage cut), MoE experts (Mixtral), a fused q/k/v
cut by slices (Phi-3), ALiBi (BLOOM, heads merged with the batch) and grouped-query
attention under sdpa (Llama as transformers builds it by default) with each rank's own
batch of one example per microbatch. 3 SGD steps; every rank checks every local gradient
at every step (shards all-gathered over tp, 1e-5) and ``state_dict()`` after them (the
plain model's names, order and values).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from examples.models import hf_zoo
from tests.helpers import zoo
from tests.helpers.compare import mismatched, state_dict_mismatches
from tests.helpers.dist import run_ranks
from tests.smp_fx.parallel.test_tensor_parallel import _gathered
from tests.smp_fx.parallel.test_tp_grid import init_grid

GLOBAL_BATCH, STEPS, LR = 8, 3, 0.1
TOL = {"atol": 1e-5, "rtol": 1e-5}
# arch -> (placement, pipeline, microbatches, prescaled_batch, attention)
CONFIGS = {"bart": ("cluster", "interleaved", 2, False, "eager"),
           "mixtral": ("spread", "simple", 2, True, "eager"),
           "phi3": ("PTD", "interleaved", 2, False, "eager"),
           "bloom": ("cluster", "simple", 2, True, "eager"),
           "llama": ("cluster", "simple", 2, False, "sdpa")}


def _batches(arch: str) -> list[zoo.Batch]:
    return zoo.batches(arch, GLOBAL_BATCH, STEPS)


def _reference(arch: str) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return zoo.reference(arch, GLOBAL_BATCH, STEPS, lambda ps: torch.optim.SGD(ps, lr=LR),
                         CONFIGS[arch][4])


def _grid(arch: str, ref: Any) -> dict[str, Any]:
    import smp_fx as smp
    from smp_fx.world import state as smp_state

    ref_grads, ref_state = ref
    placement, pipeline, m, prescaled, attention = CONFIGS[arch]
    smp_state._reset()
    bad = init_grid(placement, pipeline, m, prescaled)
    model = smp.DistributedModel(hf_zoo.build(arch, attention=attention))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: Any, x: tuple[torch.Tensor, ...], y: torch.Tensor) -> Any:
        loss = hf_zoo.loss_fn(model(*x), y)
        model.backward(loss)
        return loss

    # prescaled: the tp ranks of a group share the rdp shard; else each dp rank its own
    parts, index = (smp.rdp_size(), smp.rdp_rank()) if prescaled else (smp.dp_size(),
                                                                        smp.dp_rank())
    share = GLOBAL_BATCH // parts
    sl = slice(index * share, (index + 1) * share)
    for step, (x, y) in enumerate(_batches(arch)):
        opt.zero_grad()
        train_step(model, tuple(t[sl] for t in x), y[sl])
        grads = _gathered(model, {n: p.grad for n, p in model.local_named_parameters()
                                  if p.grad is not None})
        bad += [f"grad {n} step {step}" for n in mismatched(grads, ref_grads[step], **TOL)]
        opt.step()
    bad += state_dict_mismatches(model.state_dict(), ref_state, **TOL)
    assert model.tp_plan is not None
    return {"bad": bad, "pp": smp.pp_rank(), "replicated": list(model.tp_plan.replicated),
            "pairs": len(model.tp_plan.pairs)}


def _all_grids(path: str) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    refs = torch.load(path, weights_only=True)
    return {arch: _grid(arch, refs[arch]) for arch in CONFIGS}


@pytest.mark.multiproc
def test_hf_grid_matches_single_process_model(tmp_path: Any) -> None:
    path = str(tmp_path / "reference.pt")  # by file: too many tensors to hand to processes
    torch.save({arch: _reference(arch) for arch in CONFIGS}, path)
    results = run_ranks(_all_grids, 8, path, timeout=600, env={"SMP_FX_DEVICE_SPEC": "a100"})
    for arch in CONFIGS:
        got = [r[arch] for r in results]
        assert [g["bad"] for g in got] == [[]] * 8, (arch, [g["bad"] for g in got])
        assert all(g["replicated"] == [] and g["pairs"] > 0 for g in got), arch
        assert {g["pp"] for g in got} == {0, 1}, arch
