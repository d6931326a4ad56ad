"""A split backward's stage compiled whole with its GEMMs' weight gradients deferred to W:
the rewrite leaves the stage's graph as it was and covers each layout of a GEMM on a
parameter (``nn.Linear``, ``F.linear``, GPT-2's ``addmm``, ``x @ W.t()``, chained GEMMs,
one weight used twice); I gives the inputs' gradients and the gradients of the parameters
read inside the graph, W the GEMMs' weights', together the plain backward's; eagerly, under
``aot_eager`` and inductor, at two sequence lengths; a graph break runs the rewrite eagerly,
still split, and says why."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp_fx.runtime.executor.compiled import CompiledStage, CompileStats, compile_stages
from smp_fx.runtime.executor.deferred_gemms import DeferredStage, defer_gemms
from smp_fx.runtime.executor.seams import StageRunner


@torch.fx.wrap
def _noisy(x: torch.Tensor) -> torch.Tensor:
    print("a graph break")  # dynamo cannot put a print in a graph
    return x * 2


class _Layouts(nn.Module):
    """Every GEMM layout ``as_linear`` knows, a norm and an activation between them."""

    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.ln, self.up = nn.LayerNorm(8), nn.Linear(8, 16)
        self.mid = nn.Parameter(torch.randn(12, 16) / 4)  # F.linear, no bias
        self.conv_w = nn.Parameter(torch.randn(12, 12) / 4)  # addmm: (in, out), GPT-2's
        self.conv_b = nn.Parameter(torch.randn(12) / 4)
        self.down = nn.Parameter(torch.randn(8, 12) / 4)  # x @ W.t()
        self.frozen = nn.Linear(8, 8).requires_grad_(False)  # not deferred: no gradient
        self.noisy = noisy

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.gelu(self.up(self.ln(x)))
        h = F.linear(_noisy(h) if self.noisy else h, self.mid)
        h = torch.addmm(self.conv_b, h.reshape(-1, 12), self.conv_w)
        h = h.reshape(x.shape[0], x.shape[1], 12)
        out = x + h @ self.down.t()
        again = self.up(self.frozen(out))  # a weight used twice; chained GEMMs
        return out, again  # a GEMM's output is the stage's


def _runner(module: nn.Module) -> StageRunner:
    gm = torch.fx.symbolic_trace(module)
    return StageRunner(type("Stage", (), {"recvs": ((0, ("x",)),), "module": gm})(),
                       torch.device("cpu"))


def _check(runner: StageRunner, plain: nn.Module, rows: int) -> None:
    """One I and one W of ``runner`` against the plain module's backward."""
    for p in [*runner.stage.module.parameters(), *plain.parameters()]:
        p.grad = None
    x = torch.randn(2, rows, 8, requires_grad=True)
    g = [torch.randn(2, rows, 8), torch.randn(2, rows, 16)]
    outs = list(runner.forward([x], 0))
    (gx,), pending = runner.backward_input(outs, g, [x], 0)
    before = {n: p.grad for n, p in runner.stage.module.named_parameters()}
    assert all(v is None for v in before.values()), "I accumulates no gradient"
    runner.backward_weight(pending, 0)
    x0 = x.detach().requires_grad_()
    expected = plain(x0)
    torch.autograd.backward(expected, g)
    for got, want in zip(outs, expected):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(gx, x0.grad)
    _same_grads(runner, plain)


def _same_grads(runner: StageRunner, plain: nn.Module) -> None:
    want = dict(plain.named_parameters())
    for name, p in runner.stage.module.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, msg=name)


def test_the_rewrite_defers_every_layout_and_leaves_the_stage_as_it_was() -> None:
    gm = torch.fx.symbolic_trace(_Layouts())
    code = gm.code
    d = defer_gemms(gm)
    assert gm.code == code
    # up (twice), mid, conv_w, down; frozen stays a GEMM of the graph
    assert (len(d.weights), d.out_in, d.outputs) == (5, (True, True, False, True, True), 2)
    assert d.weights[0] is d.weights[4] is gm.up.weight
    assert {n: id(p) for n, p in d.module.named_parameters()} == {
        n: id(p) for n, p in gm.named_parameters()}  # the same tensors, no copy


@pytest.mark.parametrize("backend", [  # inductor's C++ builds are processes of their own
    "aot_eager", pytest.param("inductor", marks=pytest.mark.multiproc)])
def test_i_then_w_give_the_plain_backward(backend: str) -> None:
    torch.manual_seed(0)
    plain = _Layouts()
    runner = _runner(_Layouts())
    runner.stage.module.load_state_dict(plain.state_dict())
    st = compile_stages({1: runner}, backend, "zero_bubble")[1]
    assert isinstance(runner.module, DeferredStage) and runner.deferred is runner.module
    for rows in (4, 6, 7):  # the second recompiles with a dynamic dimension
        _check(runner, plain, rows)
    assert (st.compiles, st.recompiles, st.fallback, st.deferred) == (2, 1, None, 5)
    assert st.summary() == ("stage 1: compiled whole, 5 GEMMs' weight gradients deferred to "
                            "W; parameters 4 in I, 4 in W")  # ln's 2, up's and conv's biases


def test_a_graph_break_runs_the_rewrite_eagerly_still_split(
        caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    plain = _Layouts(noisy=True)
    runner = _runner(_Layouts(noisy=True))
    runner.stage.module.load_state_dict(plain.state_dict())
    with caplog.at_level(logging.WARNING, "smp_fx.compile"):
        st = compile_stages({1: runner}, "aot_eager", "zero_bubble")[1]
        for rows in (4, 5):
            _check(runner, plain, rows)
    assert st.fallback is not None and "print" in st.fallback
    assert st.summary().startswith("stage 1: eager, 8 parameters (Unsupported")
    assert sum("stage 1 runs eagerly" in r.message for r in caplog.records) == 1


def test_a_whole_backward_on_a_deferred_stage_still_gives_every_gradient() -> None:
    """A schedule's plain B on the stage: the weights' gradients come through the sinks."""
    torch.manual_seed(0)
    plain, runner = _Layouts(), _runner(_Layouts())
    runner.stage.module.load_state_dict(plain.state_dict())
    compile_stages({1: runner}, "aot_eager", "zero_bubble")
    x = torch.randn(2, 3, 8)
    g = [torch.randn(2, 3, 8), torch.randn(2, 3, 16)]
    runner.backward(list(runner.forward([x], 0)), g, 0)
    torch.autograd.backward(plain(x), g)
    deferred: Any = runner.deferred
    assert deferred._sinks == {}
    _same_grads(runner, plain)


def test_the_first_chunk_is_compiled_whole_without_deferring() -> None:
    """A chunk whose inputs need no gradient: its backward is all W, nothing to split."""
    runner = _runner(_Layouts())
    runner.stage.recvs = ()
    st = compile_stages({0: runner}, "aot_eager", "zero_bubble")[0]
    assert isinstance(runner.module, CompiledStage) and runner.deferred is None
    runner.forward([torch.randn(2, 3, 8)], 0)
    assert st.summary() == "stage 0: compiled whole, 8 parameters"
    assert CompileStats(0, params=3).summary() == (
        "stage 0: nothing compiled yet, 3 parameters (not run, or no tensor operation reached "
        "the compiler)")


class _ValueShaped(nn.Module):
    """A GEMM on rows picked by value: its output's shape is not known before the values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.lin(x[x[:, 0] > -100.0]),)


def test_shapes_fake_tensors_cannot_find_run_the_stage_eagerly_still_split(
        caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    plain, runner = _ValueShaped(), _runner(_ValueShaped())
    runner.stage.module.load_state_dict(plain.state_dict())
    with caplog.at_level(logging.WARNING, "smp_fx.compile"):
        st = compile_stages({1: runner}, "aot_eager", "zero_bubble")[1]
        for rows in (4, 5):
            x, g = torch.randn(rows, 8, requires_grad=True), torch.randn(rows, 8)
            (out,) = runner.forward([x], 0)
            (gx,), pending = runner.backward_input([out], [g], [x], 0)
            assert all(p.grad is None for p in runner.stage.module.parameters())
            runner.backward_weight(pending, 0)
            x0 = x.detach().requires_grad_()
            (want,) = plain(x0)
            want.backward(g)
            torch.testing.assert_close(gx, x0.grad)
            _same_grads(runner, plain)
            for p in [*runner.stage.module.parameters(), *plain.parameters()]:
                p.grad = None
    assert st.fallback is not None and st.fallback.startswith(
        "its GEMMs' output shapes could not be found on fake tensors"), st.fallback
    assert sum("stage 1 runs eagerly" in r.message for r in caplog.records) == 1


def test_under_bf16_autocast_the_weights_get_fp32_gradients_of_the_plain_backward() -> None:
    """Autocast runs the GEMMs in bf16 (forward, I's input gradients, W's weight gradients);
    the fp32 weights get fp32 gradients, as under the plain backward (bf16 rounding apart)."""
    torch.manual_seed(0)
    plain, runner = _Layouts(), _runner(_Layouts())
    runner.stage.module.load_state_dict(plain.state_dict())
    compile_stages({1: runner}, "aot_eager", "zero_bubble")
    x = torch.randn(2, 4, 8, requires_grad=True)
    g = [torch.randn(2, 4, 8), torch.randn(2, 4, 16)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = list(runner.forward([x], 0))
        (gx,), pending = runner.backward_input(outs, g, [x], 0)
        runner.backward_weight(pending, 0)
        x0 = x.detach().requires_grad_()
        torch.autograd.backward(plain(x0), g)
    assert gx is not None and gx.dtype == torch.float32
    want = dict(plain.named_parameters())
    for name, p in runner.stage.module.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32, name
            torch.testing.assert_close(p.grad, want[name].grad, atol=5e-2, rtol=5e-2, msg=name)
    torch.testing.assert_close(gx, x0.grad, atol=5e-2, rtol=5e-2)
