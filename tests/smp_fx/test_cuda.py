"""The CUDA paths, on a machine with a GPU (every test here is skipped without one).

One process runs every stage (one GPU: both stages on ``cuda:0``), so what is checked is
what a single GPU can show: stages, parameters, inputs and messages placed on the device
and the numerics there equal to the plain model on the same device (TF32 off, cuDNN
deterministic, fp32, 1e-5); fp16 with the loss scaler's tensors on the GPU; bf16 autocast
carried from the step function's thread into the threads that run the work; activation
offloading through pinned host memory and a side stream, which must not change a number.
With two GPUs, the stages on ``cuda:0`` and ``cuda:1`` copy between them on their transfer
streams, which must not change a number either (skipped on one GPU).
NCCL between processes needs a GPU per rank and is not covered by one GPU. Run with
``SMP_FX_TEST_GPU=1 pytest -m gpu`` (``make test`` hides the GPUs: see conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import smp_fx as smp
from smp_fx.runtime.transport.transport import InProcessTransport
from smp_fx.world import state
from tests.helpers.memory import train
from tests.helpers.numerics import Pair, init, train_step_of, twin_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device, and SMP_FX_TEST_GPU=1 (the suite hides GPUs otherwise)")]


@pytest.fixture(autouse=True)
def _exact_kernels() -> Iterator[None]:
    """fp32 matmuls and convolutions without TF32, deterministic cuDNN algorithms."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
     torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "hf_gpt2", "hf_bert"])
def test_pipeline_on_the_gpu_equals_the_plain_model(name: str, pipeline: str) -> None:
    init(2, 4, pipeline)
    assert state.get().device.type == "cuda"
    pair = Pair(name, device="cuda")
    pair.compare(3, 4)
    assert len(pair.dm.program.stages) == 2
    for n, p in pair.dm.local_named_parameters():
        assert p.device.type == "cuda" and p.grad is not None and p.grad.device.type == "cuda", n


@pytest.mark.parametrize(("pipeline", "v"), [("simple", 2), ("interleaved", 2),
                                             ("zero_bubble", 1), ("zero_bubble", 2),
                                             ("zbv", 2)])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_chunked_and_zero_bubble_schedules_on_the_gpu(name: str, pipeline: str,
                                                      v: int) -> None:
    init(2, 4, pipeline, virtual_pipeline_degree=v)
    pair = Pair(name, device="cuda")
    pair.compare(3, 4)
    assert len(pair.dm.program.stages) == 2 * v
    for n, p in pair.dm.local_named_parameters():
        assert p.device.type == "cuda" and p.grad is not None and p.grad.device.type == "cuda", n


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=(
    "the transfer streams copy between two GPUs; with one, both stages sit on cuda:0 and "
    "hand their values over by reference (nothing to copy)"))
@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_transfer_streams_between_two_gpus_equal_the_plain_model(pipeline: str) -> None:
    init(2, 4, pipeline)
    pair = Pair("mlp", device="cuda")
    loss_fn = pair.ex.loss_fn

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = model(x)  # on the last stage's GPU, cuda:1
        loss = loss_fn(out, y.to(out.device))
        model.backward(loss)
        return out, loss

    pair.train_step = train_step
    pair.compare(3, 4)
    executor = pair.dm.executor
    assert {r.device for r in executor.runners.values()} == {torch.device("cuda", 0),
                                                             torch.device("cuda", 1)}
    transport = executor.transport
    assert isinstance(transport, InProcessTransport) and transport.streams.off is None
    assert transport.streams.copies >= 2 * 4 * 3  # an activation and a gradient per microbatch


def test_fp16_trains_with_the_loss_scaler_on_the_gpu() -> None:
    """fp16 parameters on the GPU; the scaler's scale and overflow flag live there too; the
    losses follow the fp32 model's within half precision."""
    init(2, 2, "interleaved", fp16=True)
    ex, ref, dm = twin_models("mlp")
    ref.cuda()
    opt = smp.DistributedOptimizer(torch.optim.Adam(dm.parameters(), lr=1e-3),
                                   dynamic_loss_scale=True, init_scale=2.0**12)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    step = train_step_of(ex)
    x, y = ex.example_inputs(8)[0].cuda(), ex.example_targets(8).cuda()
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        _, loss = step(dm, x, y)
        ref_loss = ex.loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        opt.step()
        torch.testing.assert_close(loss.reduce_mean().float(), ref_loss.detach(),
                                   atol=2e-2, rtol=2e-2)
    for n, p in dm.local_named_parameters():
        assert p.device.type == "cuda" and p.dtype == torch.float16, n


def test_bf16_autocast_reaches_the_stages_and_equals_plain_autocast() -> None:
    """Autocast entered around the step function applies where the stages run: the same
    bf16 outputs as the plain model under the same autocast, and its gradients to bf16's
    rounding (1.5e-5 apart seen on an H100)."""
    init(2, 2, "simple")
    ex, ref, dm = twin_models("mlp")
    ref.cuda()
    step = train_step_of(ex)
    x, y = ex.example_inputs(8)[0].cuda(), ex.example_targets(8).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, loss = step(dm, x, y)
        ref_out = torch.cat([ref(xm) for xm in x.chunk(2)])
        ref_loss = sum(ex.loss_fn(ref(xm), ym) / 2 for xm, ym in zip(x.chunk(2), y.chunk(2)))
    ref_loss.backward()
    assert out.concat().dtype == torch.bfloat16
    torch.testing.assert_close(out.concat(), ref_out, atol=0, rtol=0)
    torch.testing.assert_close(loss.reduce_mean(), ref_loss.detach(), atol=1e-6, rtol=0)
    grads = dict(ref.named_parameters())
    for n, p in dm.local_named_parameters():  # bf16 gradients: within bf16's rounding
        torch.testing.assert_close(p.grad, grads[n].grad, atol=1e-4, rtol=1e-2)


def test_offloading_through_pinned_memory_changes_no_number() -> None:
    """Checkpointed regions whose inputs go to pinned host memory on a side stream and come
    back before their backward: the same losses and parameters as keeping them on the GPU,
    and the plan's offloaded bytes are what left the device."""
    kept, off = train("group_2", adam=True), train("group_2", offload=True, adam=True)
    assert kept.losses == off.losses
    for n, p in kept.params.items():
        assert p.device.type == "cuda", n
        torch.testing.assert_close(off.params[n], p, atol=0, rtol=0)
    for s, st in enumerate(off.plan.stages):
        rec = off.saved[s][0]
        assert rec.offloaded == st.memory.offloaded_per_microbatch > 0
        assert rec.on_device == st.memory.activations_per_microbatch


def test_checkpointing_recomputes_the_same_dropout_masks_on_the_gpu() -> None:
    """The CUDA generator's state is restored for the recompute: the same training as
    without checkpointing."""
    plain, ckpt = train(None, adam=True), train("each", adam=True)
    assert plain.losses == ckpt.losses
    for n, p in plain.params.items():
        torch.testing.assert_close(ckpt.params[n], p, atol=1e-6, rtol=0)
