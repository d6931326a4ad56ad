"""The new schedules with the other parallelisms, across real processes (gloo).

Each new schedule (looped BFS, Megatron's interleaving, ZB-H1, interleaved zero bubble,
ZB-V) runs, on 4 ranks, with:

* pp=2 x dp=2, ``ddp`` with ZeRO-1 (``shard_optimizer_state``), activation checkpointing
  and offloading, on the GPT example, whose embedding is tied to its LM head (on two ranks
  under round robin, on one under ZB-V's V): 3 Adam steps, every gradient after every step
  and every parameter after them within 1e-5 of one process on the global batch. Adam's
  ``eps`` is 1e-6: the attention's key bias has a zero gradient up to rounding, which
  Adam's default 1e-8 turns into full-size steps of opposite signs;
* ``fp16`` with the dynamic loss scaler: 3 SGD steps track the fp32 reference, the global
  norm of the master gradients (``clip_master_grads``, the whole model's) matches it, and
  an inf on one rank skips the step everywhere with one halved scale;
* global gradient clipping (``clip_grad_norm_``): the unpartitioned model's norm and
  clipped gradients;
* sharded data parallelism (``sharded_data_parallel_degree`` 2): gradients and parameters;
* pp=2 x tp=2: tensor-parallel blocks (their collectives inside I and W) against one
  process, gradients gathered over tp.

Partial checkpoints: saved at v = 2, resumed at v = 1 and at pp = 4; saved at v = 1,
resumed at v = 2 under ZB-V; training continues as the uninterrupted run does.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tests.helpers.compare import Checks, mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.twin import Twin, agree, init, on_rank

NEW = (("simple", 2), ("interleaved", 2), ("zero_bubble", 1), ("zero_bubble", 2), ("zbv", 2))
FP16_TOL = 2e-3


def _adam(c: Checks, pipe: str, v: int, checkpointed: bool | None = None,
          **extra: Any) -> Twin:
    """3 Adam steps of the GPT against one process; ``checkpointed`` None: every block
    checkpointed unless sharded data parallelism is on."""
    import smp_fx as smp

    init(2, 4, pipeline=pipe, virtual_pipeline_degree=v, **extra)
    t = Twin("gpt", model_kwargs={"n_layer": 8})
    if checkpointed is None:
        checkpointed = "sharded_data_parallel_degree" not in extra
    if checkpointed:
        for block in t.dm.module.h:
            smp.set_activation_checkpointing(block)
    opt = smp.DistributedOptimizer(torch.optim.Adam(t.dm.parameters(), lr=1e-3, eps=1e-6))
    ref_opt = torch.optim.Adam(t.ref.parameters(), lr=1e-3, eps=1e-6)
    tag = f"{pipe} v={v} {extra}"
    for i in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, ref_loss = t.smp_step(), t.ref_step()
        c.expect(abs(loss - ref_loss) < 1e-5, f"{tag}: loss at step {i}")
        bad = mismatched(t.local(grads=True), t.reference(grads=True), atol=1e-5)
        c.expect(not bad, f"{tag}: gradients at step {i} {bad[:3]}")
        opt.step()
        ref_opt.step()
    bad = mismatched(t.local(), t.reference(), atol=1e-5)
    c.expect(not bad, f"{tag}: parameters {bad[:3]}")
    return t


def _fp16_and_clipping(c: Checks, pipe: str, v: int) -> None:
    import smp_fx as smp

    init(2, 4, fp16=True, pipeline=pipe, virtual_pipeline_degree=v)
    t = Twin("gpt", model_kwargs={"n_layer": 4})
    opt = smp.DistributedOptimizer(
        torch.optim.SGD(t.dm.parameters(), lr=0.1, momentum=0.9), static_loss_scale=None,
        dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0**12, "scale_window": 2})
    ref_opt = torch.optim.SGD(t.ref.parameters(), lr=0.1, momentum=0.9)
    tag, worst = f"fp16 {pipe} v={v}", 0.0
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss, ref_loss = t.smp_step(), t.ref_step()
        got = opt.clip_master_grads(1.0)
        want = torch.nn.utils.clip_grad_norm_(t.ref.parameters(), 1.0)
        c.expect(math.isclose(float(got), float(want), rel_tol=1e-2), f"{tag}: master norm")
        opt.step()
        ref_opt.step()
        worst = max(worst, abs(loss - ref_loss))
    c.expect(worst < FP16_TOL, f"{tag}: loss within {FP16_TOL} (worst {worst:.2e})")
    c.expect(not mismatched(t.local(), t.reference(), atol=FP16_TOL), f"{tag}: parameters")
    before = {n: p.clone() for n, p in t.local().items() if p is not None}
    scale = opt.loss_scale
    opt.zero_grad()
    t.smp_step()
    on_rank(1, 0, lambda: _poison(t))
    opt.step()
    c.expect(opt.overflow and opt.loss_scale == scale / 2, f"{tag}: inf halves the scale")
    c.expect(agree(opt.loss_scale), f"{tag}: one scale on every rank")
    c.expect(not mismatched(t.local(), before), f"{tag}: the inf step skipped everywhere")
    init(2, 4, pipeline=pipe, virtual_pipeline_degree=v)
    t = Twin("gpt", model_kwargs={"n_layer": 4})
    t.smp_step()
    t.ref_step()
    got = t.dm.clip_grad_norm_(0.05)
    want = torch.nn.utils.clip_grad_norm_(t.ref.parameters(), 0.05)
    c.expect(math.isclose(float(got), float(want), rel_tol=1e-6), f"clip {pipe} v={v}: norm")
    c.expect(not mismatched(t.local(grads=True), t.reference(grads=True), atol=1e-7),
             f"clip {pipe} v={v}: clipped gradients")


def _poison(t: Twin) -> None:
    _, p = next(iter(t.dm.local_named_parameters()))
    assert p.grad is not None
    p.grad.view(-1)[0] = math.inf


def _data_parallel_body() -> tuple[int, list[str]]:
    from smp_fx.world import state

    c = Checks()
    try:
        for pipe, v in NEW:
            _adam(c, pipe, v, shard_optimizer_state=True)
            _adam(c, pipe, v, offload_activations=True)
            _adam(c, pipe, v, sharded_data_parallel_degree=2)
            _fp16_and_clipping(c, pipe, v)
    finally:
        state._reset()
    return c.report()


_FOUR: list[tuple[tuple[int, list[str]], list[str]]] = []


def _four_ranks() -> list[tuple[tuple[int, list[str]], list[str]]]:
    """Each rank's (data-parallel report, tensor-parallel mismatches) from one spawn of 4
    ranks that runs both bodies, kept for the module's two tests."""
    if not _FOUR:
        _FOUR.extend(run_ranks(_four_body, 4, timeout=600))
    return _FOUR


@pytest.mark.multiproc
@pytest.mark.timeout(700)  # the first runs the spawn of both
def test_data_parallel_zero_checkpointing_offloading_fp16_clipping_tied() -> None:
    results = [dp for dp, _ in _four_ranks()]
    assert all(not failed for _, failed in results), [f for _, f in results if f]
    assert all(n == 5 * (3 * 7 + 10) for n, _ in results)  # every check ran


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import smp_fx as smp

        with smp.tensor_parallelism():
            self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(self.act(self.fc1(h)))


class _TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import smp_fx as smp

        self.inp = nn.Linear(8, 16)
        self.blocks = nn.Sequential(*[_Block() for _ in range(4)])
        self.head = smp.nn.DistributedLinear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.tanh(self.inp(x))))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 6, (16,), generator=g))
            for _ in range(3)]


def _tp_case(pipe: str, v: int, **extra: Any) -> list[str]:
    import smp_fx as smp
    from smp_fx.world import state
    from tests.smp_fx.parallel.test_tensor_parallel import _gathered

    state._reset()
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
              "pipeline": pipe, "virtual_pipeline_degree": v, "microbatches": 4, **extra})
    torch.manual_seed(0)
    ref = _TPNet()
    torch.manual_seed(0)
    model = smp.DistributedModel(_TPNet())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    share, index = 16 // smp.dp_size(), smp.dp_rank()
    bad: list[str] = []
    for step, (x, y) in enumerate(_batches()):
        train_step(model, x[index * share:(index + 1) * share],
                   y[index * share:(index + 1) * share])
        F.cross_entropy(ref(x), y).backward()
        got = _gathered(model, {n: p.grad for n, p in model.local_named_parameters()})
        want = {n: p.grad for n, p in ref.named_parameters()}
        bad += [f"tp {pipe} v={v}: grad {n} step {step}"
                for n in mismatched(got, want, atol=1e-5, rtol=1e-5)]
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    got = _gathered(model, {n: p.detach() for n, p in model.local_named_parameters()})
    bad += [f"tp {pipe} v={v}: param {n}" for n in mismatched(
        got, {n: p.detach() for n, p in ref.named_parameters()}, atol=1e-5, rtol=1e-5)]
    if not model.tp_plan.sharded:
        bad.append(f"tp {pipe} v={v}: nothing sharded")
    return bad


def _tensor_parallel_body() -> list[str]:
    from smp_fx.world import state

    try:
        return [b for pipe, v in NEW for b in _tp_case(pipe, v)]
    finally:
        state._reset()


def _four_body() -> tuple[tuple[int, list[str]], list[str]]:
    """``_data_parallel_body`` and then ``_tensor_parallel_body`` on one world of 4 ranks
    (joined once)."""
    dist.init_process_group("gloo")
    return _data_parallel_body(), _tensor_parallel_body()


@pytest.mark.multiproc
@pytest.mark.timeout(700)
def test_tensor_parallel() -> None:
    assert [tp for _, tp in _four_ranks()] == [[]] * 4


# ---- partial checkpoints across chunk placements and pipeline degrees ---------------------

def _init(pp: int, v: int, pipe: str) -> None:
    import os

    import smp_fx as smp
    from smp_fx.world import state

    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    state._reset()
    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "pipeline": pipe,
              "virtual_pipeline_degree": v})


def _save(pp: int, v: int, pipe: str, prefix: str) -> None:
    import smp_fx as smp
    from tests.smp_fx.ckpt.test_files_dist import _fresh, _runtime_classes

    _init(pp, v, pipe)
    model, opt, run = _fresh(*_runtime_classes(), "mlp")
    run(range(3))
    if smp.dp_rank() == 0:
        smp.save({"model": model.local_state_dict(), "opt": opt.local_state_dict()}, prefix)


def _resume(pp: int, v: int, pipe: str, prefix: str) -> bytes:
    """3 steps after loading ``prefix``, and the uninterrupted 6 steps, both at (pp, v)."""
    import smp_fx as smp
    from tests.smp_fx.ckpt.test_files_dist import _fresh, _runtime_classes, _to_cpu

    _init(pp, v, pipe)
    model, opt, run = _fresh(*_runtime_classes(), "mlp")
    ckpt = smp.load(prefix, partial=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    run(range(3, 6))
    got = (_to_cpu(model.state_dict()), _to_cpu(opt.state_dict()))
    _init(pp, v, pipe)
    model, opt, run = _fresh(*_runtime_classes(), "mlp")
    run(range(6))
    buf = io.BytesIO()
    torch.save((got, (_to_cpu(model.state_dict()), _to_cpu(opt.state_dict()))), buf)
    return buf.getvalue()


RESUMED = ((2, 1, "interleaved", "v2"), (2, 2, "zbv", "v1"))
"""The resumes on the 2 ranks that saved: (pp, v, pipeline, the checkpoint's chunks)."""


def _saved_and_resumed(prefixes: dict[str, str]) -> list[bytes]:
    """Both checkpoints saved (at v = 2 and at v = 1), then ``RESUMED`` in turn, on one
    world of 2 ranks."""
    _save(2, 2, "interleaved", prefixes["v2"])
    _save(2, 1, "interleaved", prefixes["v1"])
    dist.barrier()  # every rank's partial file written before any is read
    return [_resume(pp, v, pipe, prefixes[src]) for pp, v, pipe, src in RESUMED]


@pytest.mark.multiproc
def test_checkpoints_across_chunks_and_degrees(tmp_path: Path) -> None:
    prefixes = {"v2": str(tmp_path / "v2.pt"), "v1": str(tmp_path / "v1.pt")}
    resumed = run_ranks(_saved_and_resumed, 2, prefixes, timeout=250)[0]
    at_pp4 = run_ranks(_resume, 4, 4, 1, "interleaved", prefixes["v2"], timeout=200)[0]
    for (pp, v, pipe, src), data in zip((*RESUMED, (4, 1, "interleaved", "v2")),
                                        (*resumed, at_pp4)):
        got, want = torch.load(io.BytesIO(data), weights_only=True)
        tag = f"saved at {src}, resumed at pp {pp} v {v} {pipe}"
        torch.testing.assert_close(dict(got[0]), dict(want[0]), rtol=0, atol=1e-6,
                                   msg=lambda m, tag=tag: f"{tag}: {m}")
        torch.testing.assert_close(got[1]["state"], want[1]["state"], rtol=0, atol=1e-6,
                                   msg=lambda m, tag=tag: f"{tag}: {m}")
