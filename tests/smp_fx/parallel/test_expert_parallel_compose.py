"""Expert parallelism composed with tensor parallelism, ZeRO-1, sdp, bf16 and fp16.

One spawn of 4 gloo ranks runs each configuration of ``RUNS`` at ep 2 in turn against the
plain model trained on the global batch in the test process
(``test_expert_parallel._reference``): 3 Adam steps, the gradients clipped to a norm of
0.5, every local gradient every step (tp and sdp shards gathered, an expert slice against
its rows), the gathered ``state_dict()`` after them and each rank's load-balancing loss
every step (1e-5). Then each of ``HALF`` against one smp-fx process in that precision.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from examples.models import moe_zoo
from tests.helpers.compare import (
    mismatched,
    optimizer_state_mismatches,
    state_dict_mismatches,
)
from tests.helpers.dist import run_ranks
from tests.smp_fx.parallel.test_expert_parallel import (
    MAX_NORM,
    OPTIMIZERS,
    TOL,
    _batches,
    _expert_rows,
    _loss,
    _reference,
    step_function,
)
from tests.smp_fx.parallel.test_tensor_parallel import _gathered

RUNS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "tp2": ("deepseek_v3/adam", 2, {"tensor_parallel_degree": 2, "prescaled_batch": True}),
    "zero1": ("mixtral/adam", 4, {"shard_optimizer_state": True}),
    "sdp2": ("qwen3_moe/adam", 4, {"sharded_data_parallel_degree": 2,
                                    "sdp_param_persistence_threshold": 64,
                                    "sdp_reduce_bucket_size": 4096}),
}
"""label -> (case, rdp degree, configuration beside ``expert_parallel_degree`` 2 and
``ddp``)."""
SAVED = ("zero1", "sdp2")
"""Runs whose full optimizer ``state_dict()`` is compared with the plain Adam's."""
DELAYED = ("zero1",)
"""Runs whose model is built under ``smp.delay_param_initialization`` (each rank
materialises only its experts)."""


def _run(label: str, ref: dict[str, Any]) -> dict[str, Any]:
    import smp_fx as smp
    from smp_fx.world import state as smp_state

    case, _, extra = RUNS[label]
    arch, opt_name = case.split("/")
    smp_state._reset()
    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "expert_parallel_degree": 2,
              **extra})
    with smp.delay_param_initialization(enabled=label in DELAYED):
        module = moe_zoo.build(arch, aux=arch in moe_zoo.AUX)
    if smp.tp_size() > 1:
        smp.set_tensor_parallelism(module)
    model = smp.DistributedModel(module)
    meta = all(p.is_meta for p in model.parameters())  # delayed: materialised when placed
    opt = smp.DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()))
    train_step = step_function(arch)

    share = len(_batches()[0][0]) // smp.rdp_size()
    sl = slice(smp.rdp_rank() * share, (smp.rdp_rank() + 1) * share)
    names, rank = model.expert_names, smp.ep_rank()
    bad = []
    for step, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        aux = train_step(model, x[sl], y[sl]).stack()
        want_aux = ref["aux"][step][smp.rdp_rank()]
        if not torch.allclose(aux, want_aux, **TOL):
            bad.append(f"aux loss step {step}: {aux} != {want_aux}")
        norm = model.clip_grad_norm_(MAX_NORM)
        if not torch.allclose(norm, ref["norms"][step], **TOL):
            bad.append(f"norm step {step}: {norm} != {ref['norms'][step]}")
        grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()  # sdp: shards
                 for n, p in model.local_named_parameters() if p.grad is not None}
        if model.tp_plan is not None:
            grads = _gathered(model, grads)
        want = _expert_rows(ref["grads"][step], names, 2, rank)
        bad += [f"grad {n} step {step}" for n in mismatched(grads, want, **TOL)]
        opt.step()
    bad += state_dict_mismatches(model.state_dict(), ref["state"], **TOL)
    if label in SAVED:  # every expert's optimizer state, gathered over ep (and edp shards)
        bad += optimizer_state_mismatches(opt.state_dict(), ref["optimizer"], **TOL)
    held = [n for n, p in model.local_named_parameters()
            if any(p is q for g in opt.param_groups for q in g["params"])]
    local = {n: getattr(p, "to_local", lambda p=p: p)() for n, p in
             model.local_named_parameters()}  # sdp: this rank's shard
    expert_bytes = sum(t.numel() * t.element_size() for n, t in local.items() if n in names)
    return {"bad": bad, "coverage": [b.line() for b in model.ep_coverage], "held": held,
            "meta": meta, "expert_bytes": expert_bytes,
            "shards": sorted(n for n, p in model.local_named_parameters()
                             if hasattr(p, "full_tensor")),
            "tp_sharded": [] if model.tp_plan is None else
            [s.name for s in model.tp_plan.sharded], "experts": sorted(names)}


HALF: dict[str, tuple[str, dict[str, Any], float]] = {
    "bf16": ("mixtral/adam", {"bf16": True, "shard_optimizer_state": True}, 1.6e-2),
    "fp16": ("olmoe/adam", {"fp16": True}, 2e-3),
}
"""label -> (case, configuration, tolerance: the precision's resolution after 3 steps, as
tests/smp_fx/parallel/test_compose_dist.py); run at ep 2 on 4 ranks against one smp-fx
process in the same precision (SMP's: half weights, fp32 masters; docs/precision.md)."""


def _half(case: str, extra: dict[str, Any], ep: int) -> dict[str, Any]:
    """3 steps at ``ep`` in ``extra``'s precision, clipped by the optimizer (its fp32
    masters): each step's loss (the global batch's mean) and norm, the final state."""
    import torch.distributed as dist

    import smp_fx as smp
    from smp_fx.world import state as smp_state

    arch, opt_name = case.split("/")
    smp_state._reset()
    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "expert_parallel_degree": ep,
              **extra})
    model = smp.DistributedModel(moe_zoo.build(arch))
    opt = smp.DistributedOptimizer(OPTIMIZERS[opt_name](model.parameters()))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = _loss(model(x), y)
        model.backward(out)
        return out

    share = len(_batches()[0][0]) // smp.rdp_size()
    sl = slice(smp.rdp_rank() * share, (smp.rdp_rank() + 1) * share)
    losses, norms = [], []
    for x, y in _batches():
        opt.zero_grad()
        loss = train_step(model, x[sl], y[sl]).reduce_mean().detach().float()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= smp.rdp_size()
        losses.append(loss)
        norms.append(opt.clip_master_grads(MAX_NORM))
        opt.step()
    half = {p.dtype for n, p in model.local_named_parameters()}
    masters = {m.dtype for _, m in opt._masters.pairs}
    return {"loss": torch.stack(losses), "norm": torch.stack(norms), "dtypes": (half, masters),
            "state": {k: v.float() for k, v in model.state_dict().items()}}


def _half_differs(got: dict[str, Any], ref: dict[str, Any], resolution: float) -> list[str]:
    tol = {"atol": resolution, "rtol": resolution}
    bad = [f"{k}: {got[k]} != {ref[k]}" for k in ("loss", "norm")
           if not torch.allclose(got[k], ref[k], **tol)]
    return bad + state_dict_mismatches(got["state"], ref["state"], **tol)


def _all(path: str) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    refs = torch.load(path, weights_only=True)
    out = {label: _run(label, refs[label]) for label in RUNS}
    for label, (case, extra, resolution) in HALF.items():
        got = _half(case, extra, 2)
        out[label] = {"bad": _half_differs(got, refs[label], resolution),
                      "dtypes": got["dtypes"]}
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_ep2_composed_matches_single_process_model(tmp_path: Any) -> None:
    from smp_fx.world import state as smp_state

    path = str(tmp_path / "reference.pt")
    refs = {label: _reference(case, rdp) for label, (case, rdp, _) in RUNS.items()}
    try:
        for label, (case, extra, _) in HALF.items():  # one smp-fx process, the same precision
            refs[label] = _half(case, {k: v for k, v in extra.items()
                                       if k != "shard_optimizer_state"}, 1)
    finally:
        smp_state._reset()
    torch.save(refs, path)
    results = run_ranks(_all, 4, path, timeout=400)
    assert [r["bf16"]["dtypes"] for r in results] == [({torch.bfloat16}, {torch.float32})] * 4
    assert [r["fp16"]["dtypes"] for r in results] == [({torch.float16}, {torch.float32})] * 4
    for label in (*RUNS, *HALF):
        assert [r[label]["bad"] for r in results] == [[]] * 4, (
            label, [r[label]["bad"] for r in results])
    for label in RUNS:
        assert all("expert-parallel, 2 of 4" in line
                   for line in results[0][label]["coverage"]), label
    sharded, experts = results[0]["tp2"]["tp_sharded"], results[0]["tp2"]["experts"]
    # dense parts by tp (the shared experts too), the experts by ep, the router whole
    assert any("shared_experts" in n for n in sharded) and not set(sharded) & set(experts)
    assert not any(".mlp.gate." in n for n in sharded), sharded
    # ZeRO-1: each expert slice stepped on one rank of its edp group, the rest on one rdp rank
    held = [r["zero1"]["held"] for r in results]
    experts = set(results[0]["zero1"]["experts"])
    every = sorted(n for h in held for n in h)
    assert every == sorted(list(experts) * 2 + [n for n in set(every) if n not in experts])
    assert all(0 < len(h) < len(set(every)) for h in held)
    assert [r[label]["meta"] for r in results for label in RUNS] == [
        label in DELAYED for _ in results for label in RUNS]
    # sdp: every parameter an FSDP2 shard, the expert slices over their edp group: each
    # rank holds the experts' bytes / (ep x sdp)
    shards, experts = results[0]["sdp2"]["shards"], results[0]["sdp2"]["experts"]
    assert set(experts) < set(shards), (shards, experts)
    full = moe_zoo.build("qwen3_moe").state_dict()
    every = sum(full[n].numel() * full[n].element_size() for n in experts)
    assert [r["sdp2"]["expert_bytes"] for r in results] == [every // 4] * 4
