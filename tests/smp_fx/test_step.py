"""smp.step: splitting, StepOutput, evaluation, and the documented misuse errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import smp_fx as smp
from smp_fx.runtime.inputs.microbatch import split_inputs
from tests.helpers.numerics import init


class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return self.b(h), h.sum(1)


@pytest.fixture
def model(one_thread: None) -> smp.DistributedModel:
    init(2, 2, "interleaved")
    return smp.DistributedModel(TwoOut())


@smp.step
def train(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    out, aux = model(x)
    loss = F.cross_entropy(out, y) + 0.1 * aux.mean()
    model.backward(loss)
    return out, loss, {"n": x.shape[0]}


def test_step_outputs_and_grads(model: smp.DistributedModel) -> None:
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    ref = TwoOut()
    ref.load_state_dict(model.module.state_dict())
    out, loss, extra = train(model, x, y)
    assert isinstance(out, smp.StepOutput) and len(out.outputs) == 2
    assert extra == {"n": [3, 3]}
    torch.testing.assert_close(out.concat(), ref(x)[0])
    assert out.stack().shape == (2, 3, 3) and not out.concat().requires_grad
    ref_losses = []
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        o, a = ref(xm)
        l_mb = F.cross_entropy(o, ym) + 0.1 * a.mean()
        (l_mb / 2).backward()
        ref_losses.append(l_mb.detach())
    torch.testing.assert_close(loss.reduce_mean(), torch.stack(ref_losses).mean())
    torch.testing.assert_close(loss.reduce_sum(), torch.stack(ref_losses).sum())
    for name, p in model.local_named_parameters():
        torch.testing.assert_close(p.grad, ref.get_parameter(name).grad)


def test_sum_instead_of_average(model: smp.DistributedModel) -> None:
    init(2, 2, "interleaved")
    summing, averaging = TwoOut(), TwoOut()
    averaging.load_state_dict(summing.state_dict())
    dm = smp.DistributedModel(summing, average_grads_across_microbatches=False)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    train(dm, x, y)
    g_sum = dm.module.a.weight.grad.clone()
    avg = smp.DistributedModel(averaging)
    train(avg, x, y)
    torch.testing.assert_close(g_sum, 2 * avg.module.a.weight.grad)


def test_evaluation_under_no_grad_is_forward_only(model: smp.DistributedModel) -> None:
    @smp.step
    def evaluate(model: Any, x: torch.Tensor) -> Any:
        out, _ = model(x)
        return out

    x = torch.randn(4, 4)
    with torch.no_grad():
        out = evaluate(model, x)
    assert {op.kind for op in model.executor.stats.ops} == {"F", "SEND_ACT", "RECV_ACT"}
    assert not out.concat().requires_grad
    torch.testing.assert_close(out.concat(), model.module(x)[0])


def test_calls_outside_step_are_errors(model: smp.DistributedModel) -> None:
    with pytest.raises(smp.SMPRuntimeError, match="can only be made inside a smp.step"):
        model(torch.randn(2, 4))
    with pytest.raises(smp.SMPRuntimeError, match="can only be made inside a smp.step"):
        model.backward(torch.ones(()))


def test_indivisible_batch_is_an_error(model: smp.DistributedModel) -> None:
    with pytest.raises(smp.SMPRuntimeError, match="divisible by microbatches.*'x'"):
        train(model, torch.randn(5, 4), torch.randint(0, 3, (5,)))


def test_an_output_off_the_loss_path_gets_no_gradient(model: smp.DistributedModel) -> None:
    """An output the loss does not use (a Hugging Face cache) is accepted, as in plain
    autograd: the gradients are the loss's alone."""
    @smp.step
    def partial(model: Any, x: torch.Tensor) -> Any:
        out, aux = model(x)
        model.backward(out.sum())
        return aux

    ref = TwoOut()
    ref.load_state_dict(model.module.state_dict())
    x = torch.randn(4, 4)
    aux = partial(model, x)
    (ref(x)[0].sum() / 2).backward()  # the mean over the 2 microbatches, as smp.step's
    assert aux.concat().requires_grad is False
    for name, p in model.local_named_parameters():
        want = ref.get_parameter(name).grad
        torch.testing.assert_close(p.grad, want, msg=name)


def test_user_error_propagates_and_next_step_runs(model: smp.DistributedModel) -> None:
    @smp.step
    def boom(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        out, aux = model(x)
        if x[0, 0] > -100:
            raise ValueError("user bug")
        return out

    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    train(model, x, y)
    with pytest.raises(ValueError, match="user bug"):
        boom(model, x, y)
    _, loss, _ = train(model, x, y)
    assert torch.isfinite(loss.reduce_mean())


def test_split_rules() -> None:
    class Sliced:
        def __init__(self, n: int) -> None:
            self.n = n

        def smp_slice(self, num_mb: int, mb: int, axis: int) -> Any:
            return (self.n, num_mb, mb, axis)

    def fn(a: Any, b: Any, c: Any, d: Any = None) -> None: ...

    mbs = split_inputs((torch.arange(4), torch.zeros(2, 4), Sliced(7)),
                       {"d": [torch.arange(4)]}, 2, non_split_inputs=("c",),
                       input_split_axes={"b": 1}, fn=fn)
    (a0, b0, c0), k0 = mbs[0]
    (a1, b1, c1), k1 = mbs[1]
    assert a1.tolist() == [2, 3] and b0.shape == (2, 2) and isinstance(c0, Sliced)
    assert k1["d"][0].tolist() == [2, 3]
    mbs = split_inputs((Sliced(7),), {}, 2, fn=fn)
    assert mbs[1][0][0] == (7, 2, 1, 0)


def test_model_called_twice_in_one_microbatch(model: smp.DistributedModel) -> None:
    @smp.step
    def twice(model: Any, x: torch.Tensor) -> Any:
        model(x)
        return model(x)

    with pytest.raises(smp.SMPRuntimeError, match="once per microbatch"):
        twice(model, torch.randn(4, 4))


def test_caller_autocast_applies_to_the_stages(model: smp.DistributedModel) -> None:
    @smp.step
    def fwd(model: Any, x: torch.Tensor) -> Any:
        out, _ = model(x)
        return out

    x = torch.randn(4, 4)
    with torch.no_grad():
        fwd(model, x)  # partition in fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fwd(model, x)
        plain = fwd(model, x)
    assert out.outputs[0].dtype == torch.bfloat16 and plain.outputs[0].dtype == torch.float32


def test_every_documented_decorator_form(model: smp.DistributedModel) -> None:
    def body(model: Any, x: torch.Tensor, scale: torch.Tensor) -> Any:
        out, _ = model(x)
        return out * scale.sum()  # scale is whole (not split) in every microbatch

    x, scale = torch.randn(4, 4), torch.ones(4)
    forms = [smp.step(["scale"])(body),                      # positional, as documented
             smp.step(["scale"], {"x": 0}, True)(body),     # all three positionally
             smp.step(non_split_inputs=["scale"])(body),    # keywords
             smp.step(func=body, non_split_inputs=["scale"])]  # SMP's own keyword
    with torch.no_grad():
        outs = [f(model, x, scale).concat() for f in forms]
        bare = smp.step()(lambda model, x: model(x)[0])(model, x).concat()
    for out in outs:
        torch.testing.assert_close(out, model.module(x)[0] * 4)
    torch.testing.assert_close(bare, model.module(x)[0])
    with pytest.raises(smp.SMPRuntimeError, match="list of argument names"):
        smp.step("scale")  # a bare string would split into letters: refused at decoration
    with pytest.raises(smp.SMPRuntimeError, match="map argument names to axes"):
        smp.step(["scale"], [1])


def test_step_output_methods_clients_use(model: smp.DistributedModel) -> None:
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    out, loss, _ = smp.step(detach_outputs=False)(train.__wrapped__)(model, x, y)
    assert out.outputs[0].requires_grad
    detached = out.detach()  # the Hugging Face Trainer's smp_nested_concat: .detach().concat()
    assert isinstance(detached, smp.StepOutput) and not detached.concat().requires_grad
    torch.testing.assert_close(detached.concat(), torch.cat([o.detach() for o in out.outputs]))
    assert detached[1] is detached.outputs[1] and len(detached) == 2
    assert detached.map(lambda t: t * 0).concat().abs().sum() == 0
