"""Optimizer-state sharding (ZeRO-1) and sharded data parallelism (FSDP2) on 4 gloo ranks.

Each dp rank trains on its own slice of one batch; the reference is plain Adam on the
unpartitioned model over the whole batch. One world goes through:

* ``shard_optimizer_state`` at pp=2 x dp=2 (GPT, tied embedding across the stages):
  parameters equal plain Adam's after 3 steps; each rank holds 1/dp of the optimizer-state
  bytes within one parameter's state; ``state_dict()`` gathers the plain Adam state;
  ``local_state_dict()`` (the stage's merged shards) and ``local_state_dict(gather_if_shard=
  False)`` (this rank's shard) reload at the same dp size; ``smp.save_checkpoint`` there
  resumes at pp=1 x dp=4; the full state and weights load at that layout (ZeRO over 4)
  and a further step still equals plain Adam; the per-rank files of
  ``smp.save(..., v3=True)`` (the Hugging Face Trainer's) reload the whole state;
* sharded data parallelism at pp=2 x sdp=2 (GPT) and pp=1 x dp=4 x sdp=2 (HSDP, MLP, small
  units and replicated small parameters): parameters equal plain Adam's with the global
  norm clipped to ``sdp_gradient_clipping`` after 3 steps, and ``optimizer._global_grad_norm``
  (what AWS's ``train.py`` logs) is the reference's norm before clipping.
"""

from __future__ import annotations

import copy
import shutil
from typing import Any

import pytest
import torch

from tests.helpers.compare import Checks, mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.twin import Twin, init

ATOL = 1e-5
CHECKS = 24  # every rank makes each check of the docstring


def _adam(params: Any) -> torch.optim.Optimizer:
    """Adam with eps 1e-4: GPT's attention key bias has an exactly-zero gradient that
    arrives as ~1e-9 of rounding noise, which the default eps would blow up to +-lr."""
    return torch.optim.Adam(params, lr=1e-2, eps=1e-4)


def _train(t: Twin, opt: Any, ref_opt: Any, steps: int, clip: float = 0.0) -> float:
    """``steps`` steps of both; the reference's last gradient norm (before clipping)."""
    norm = 0.0
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        t.smp_step()
        t.ref_step()
        if clip:
            norm = float(torch.nn.utils.clip_grad_norm_(t.ref.parameters(), clip))
        opt.step()
        ref_opt.step()
    return norm


def _zero_checks(c: Checks, folder: str) -> tuple[dict[str, Any], dict[str, Any], Twin]:
    import smp_fx as smp

    init(2, 2, shard_optimizer_state=True)
    t = Twin("gpt")
    opt = smp.DistributedOptimizer(_adam(t.dm.parameters()))
    ref_opt = _adam(t.ref.parameters())
    _train(t, opt, ref_opt, 3)
    c.expect(not mismatched(t.local(), t.reference(), atol=ATOL), "zero: parameters")
    mine = opt.local_state_bytes()
    per_param = {n: 2 * p.numel() * p.element_size() + 4
                 for n, p in t.dm.local_named_parameters()}
    total = sum(smp.allgather(mine, smp.DP_GROUP))
    c.expect(total == sum(per_param.values()), "zero: shards add up to the whole state")
    c.expect(abs(mine - total / smp.dp_size()) <= max(per_param.values()),
             "zero: 1/dp of the state within one parameter")
    full = opt.state_dict()
    c.expect(_same_state(full, ref_opt.state_dict()), "zero: state_dict() is plain Adam's")
    stage = opt.local_state_dict()  # gather_if_shard: this stage's dp shards merged
    shard = opt.local_state_dict(gather_if_shard=False)
    c.expect(len(shard["state"]) < len(stage["state"]), "zero: the shard is a part")
    for saved in (shard, stage):
        opt.optimizer.state.clear()
        opt.load_state_dict(saved)
        c.expect(_same_state(opt.state_dict(), full), "zero: local_state_dict reloads")
    smp.save_checkpoint(folder, "zero", model=t.dm, optimizer=opt)
    # the Hugging Face Trainer's optimizer file: each rank its shard, v3=True
    path = f"{folder}/optimizer.pt"
    smp.save(shard, path, partial=True, v3=shard_state(opt))
    smp.barrier()  # every replica's files are written before any rank reads them
    opt.optimizer.state.clear()
    opt.load_state_dict(smp.load(path, partial=True, back_compat=True))
    c.expect(_same_state(opt.state_dict(), full), "zero: v3 per-rank files reload")
    return full, t.dm.state_dict(), t


def shard_state(opt: Any) -> bool:
    import smp_fx as smp

    return bool(smp.state.cfg.shard_optimizer_state) and opt.shards_state


def _zero_other_layout(c: Checks, opt_sd: dict[str, Any], model_sd: dict[str, Any],
                       before: Twin, folder: str) -> None:
    import smp_fx as smp

    init(1, 1, shard_optimizer_state=True)
    t = Twin("gpt")
    t.ref.load_state_dict(before.ref.state_dict())
    opt = smp.DistributedOptimizer(_adam(t.dm.parameters()))
    smp.resume_from_checkpoint(folder, "zero")  # saved at pp=2 x dp=2
    t.train_step(t.dm, *t.x_local, t.y_local)  # partitions: the checkpoint loads
    opt.zero_grad()
    c.expect(not mismatched(t.local(), {n: model_sd[n] for n in t.local()}),
             "zero: checkpoint resumes the weights at dp 4")
    c.expect(_same_state(opt.state_dict(), opt_sd), "zero: checkpoint resumes the state")
    opt.optimizer.state.clear()
    t.dm.load_state_dict(model_sd)
    opt.load_state_dict(opt_sd)
    ref_opt = _adam(t.ref.parameters())
    ref_opt.load_state_dict(copy.deepcopy(opt_sd))  # torch's loading aliases the tensors
    _train(t, opt, ref_opt, 1)
    bad = mismatched(t.local(), t.reference(), atol=ATOL)
    c.expect(not bad, f"zero: dp 2 -> 4 {bad[:4]}")


def _sdp_checks(c: Checks) -> None:
    import smp_fx as smp

    for pp, name, extra in ((2, "gpt", {"sdp_param_persistence_threshold": 100}),
                            (1, "mlp", {"sdp_reduce_bucket_size": 300,
                                        "sdp_param_persistence_threshold": 40})):
        sdp = 2
        init(pp, 2, sharded_data_parallel_degree=sdp, **extra)
        t = Twin(name)
        opt = smp.DistributedOptimizer(_adam(t.dm.parameters()))
        ref_opt = _adam(t.ref.parameters())
        norm = _train(t, opt, ref_opt, 3, clip=1.0)
        tag = f"sdp pp={pp} dp={smp.dp_size()}"
        c.expect(not mismatched(t.local(), t.reference(), atol=ATOL), f"{tag}: parameters")
        c.expect(abs(opt._global_grad_norm - norm) <= 1e-5 * max(norm, 1.0),
                 f"{tag}: optimizer._global_grad_norm {opt._global_grad_norm} vs {norm}")
        sharded = [p for p in t.dm.local_parameters() if hasattr(p, "full_tensor")]
        c.expect(bool(sharded), f"{tag}: parameters are sharded")
        # gradient accumulation (AWS's train.py: two smp.steps, then optimizer.step): the
        # shards' gradients sum over the steps as the reference's do
        opt.zero_grad()
        ref_opt.zero_grad()
        for _ in range(2):
            t.smp_step()
            t.ref_step()
        torch.nn.utils.clip_grad_norm_(t.ref.parameters(), 1.0)
        opt.step()
        ref_opt.step()
        c.expect(not mismatched(t.local(), t.reference(), atol=ATOL),
                 f"{tag}: two steps accumulated")
        # checkpoints hold whole tensors (gathered over the shard group) and load back as
        # shards: a step after loading repeats the step after saving
        model_sd = {k: v.clone() if isinstance(v, torch.Tensor) else v
                    for k, v in t.dm.local_state_dict().items()}
        opt_sd = copy.deepcopy(opt.local_state_dict())  # as written to a file (Adam's step
        whole = [k for k, v in model_sd.items() if isinstance(v, torch.Tensor)
                 and hasattr(dict(t.dm.local_named_parameters()).get(k), "full_tensor")]
        opt.zero_grad()  # counters are updated in place and CPU tensors are not copied)
        t.smp_step()
        opt.step()
        after = {k: v.clone() for k, v in t.local().items() if v is not None}
        t.dm.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        opt.zero_grad()
        t.smp_step()
        opt.step()
        c.expect(bool(whole) and not mismatched(t.local(), after, atol=ATOL),
                 f"{tag}: checkpoint round trip")


def _sdp_bf16_checks(c: Checks) -> None:
    """bf16 with sharded data parallelism (AWS's train.py notebooks): bf16 shards, fp32
    master shards stepped by the optimizer and clipped by ``sdp_gradient_clipping``; within
    bf16's resolution of the fp32 reference after three steps."""
    import smp_fx as smp

    init(1, 2, sharded_data_parallel_degree=2, bf16=True, sdp_reduce_bucket_size=300,
         sdp_param_persistence_threshold=40, sdp_gradient_clipping=0.05)
    t = Twin("mlp")
    opt = smp.DistributedOptimizer(_adam(t.dm.parameters()))
    ref_opt = _adam(t.ref.parameters())
    norm = _train(t, opt, ref_opt, 3, clip=0.05)  # clipping active: the norms are larger
    tag = f"sdp bf16 dp={smp.dp_size()}"
    local = {k: v for k, v in t.local().items() if v is not None}
    c.expect(not mismatched(local, t.reference(), atol=3e-2, rtol=3e-2), f"{tag}: parameters")
    c.expect(abs(opt._global_grad_norm - norm) <= 3e-2 * norm,
             f"{tag}: _global_grad_norm {opt._global_grad_norm} vs {norm}")
    halves = [p for p in t.dm.local_parameters() if hasattr(p, "full_tensor")]
    c.expect(bool(halves) and all(p.dtype == torch.bfloat16 for p in halves),
             f"{tag}: bf16 shards")


def _shared_dir() -> str:
    """One temporary folder for the world (rank 0 makes it)."""
    import tempfile

    import torch.distributed as dist

    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box[0] = tempfile.mkdtemp(prefix="smp_fx_zero_")
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(not mismatched({k: v for k, v in a["state"][i].items()},
                              b["state"][i], atol=ATOL) for i in a["state"])


def _body() -> tuple[int, list[str]]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    c = Checks()
    folder = ""
    try:
        folder = _shared_dir()
        opt_sd, model_sd, twin = _zero_checks(c, folder)
        _zero_other_layout(c, opt_sd, model_sd, twin, folder)
        _sdp_checks(c)
        _sdp_bf16_checks(c)
    finally:
        if dist.get_rank() == 0 and folder:
            shutil.rmtree(folder, ignore_errors=True)
    return c.report()


@pytest.mark.multiproc
def test_sharding_on_four_ranks() -> None:
    for count, failed in run_ranks(_body, 4, timeout=300):
        assert count == CHECKS and not failed, (count, failed)
