"""The split backward: I then W equal one full backward, nothing is computed twice, and a
checkpointed region is rebuilt once for both."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from smp_fx.runtime.executor.split_backward import (
    Accumulators,
    _parents,
    input_grads,
    weight_grads,
)
from smp_fx.runtime.memory.recompute_once import checkpoint_once


class Chunk(nn.Module):
    """Linear, LayerNorm, a parameter multiplied in; optionally a layer used twice, an
    output made of a parameter alone, a checkpointed body, or a value made of a parameter
    alone that is both added onto the input path and an output (``tee``: T5's position
    bias, computed in the first decoder layer, sent on to the later ones)."""

    def __init__(self, shared: bool = False, side: bool = False, ckpt: bool = False,
                 tee: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.b = nn.Linear(8, 8)
        self.p = nn.Parameter(torch.randn(8))
        self.q = nn.Parameter(torch.randn(8))
        self.shared, self.side, self.ckpt, self.tee = shared, side, ckpt, tee
        self.runs = 0

    def body(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        h = self.b(torch.relu(self.ln(self.a(x)))) * self.p
        return self.a(torch.tanh(h)) if self.shared else h

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = checkpoint_once(self.body, x) if self.ckpt else self.body(x)
        if self.tee:
            bias = self.q * 2.0
            return h + bias, bias
        return (h, self.p * 3.0) if self.side else (h,)


def _twins(**kw: Any) -> tuple[Chunk, Chunk]:
    torch.manual_seed(0)
    a = Chunk(**kw)
    b = Chunk(**kw)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("kw", [{}, {"shared": True}, {"side": True}, {"ckpt": True},
                                {"ckpt": True, "shared": True}, {"tee": True}])
@pytest.mark.parametrize("needs_grad", [True, False])
def test_i_then_w_equal_one_backward(kw: dict[str, Any], needs_grad: bool) -> None:
    split, whole = _twins(**kw)
    x = torch.randn(4, 8, requires_grad=needs_grad)
    x2 = x.detach().clone().requires_grad_(needs_grad)
    outs = split(x)
    gouts = [torch.randn_like(o) for o in outs]
    runs: dict[Any, int] = {}
    for node in _parents([o.grad_fn for o in outs]):
        node.register_hook(lambda gi, go, n=node: runs.__setitem__(n, runs.get(n, 0) + 1))
    gx, pending = input_grads(list(outs), gouts, [x], list(split.parameters()))
    assert all(p.grad is None for p in split.parameters()), "I touched a weight gradient"
    weight_grads(pending)
    torch.autograd.backward(list(whole(x2)), gouts)
    if needs_grad:
        torch.testing.assert_close(gx[0], x2.grad, rtol=0, atol=1e-6)
    else:
        assert gx == [None] and not pending.joins  # the first chunk: W is the backward
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
    # the input path and the parameters' paths each run once; only the joins run twice,
    # each time for its other outputs
    twice = {type(n).__name__ for n, k in runs.items() if k > 1}
    assert twice == {type(j.node).__name__ for j in pending.joins if not j.roots}
    assert all(k <= 2 for k in runs.values())


def test_weight_gradients_accumulate_through_their_hooks() -> None:
    # DDP's reducer and FSDP listen on AccumulateGrad: W must go through it
    lin = nn.Linear(8, 8)
    fired: list[str] = []
    for name, p in lin.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=name: fired.append(n))
    x = torch.randn(2, 8, requires_grad=True)
    y = lin(x)
    _, pending = input_grads([y], [torch.ones_like(y)], [x], list(lin.parameters()))
    assert fired == []
    weight_grads(pending)
    assert sorted(fired) == ["bias", "weight"]


def test_a_relayed_input_gets_its_gradient() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    gs = [torch.randn(4, 8), torch.randn(4, 8)]
    gx, pending = input_grads([lin(x), x], gs, [x], list(lin.parameters()))
    weight_grads(pending)
    x2 = x.detach().clone().requires_grad_()
    ref = nn.Linear(8, 8)
    ref.load_state_dict(lin.state_dict())
    torch.autograd.backward([ref(x2), x2], gs)
    torch.testing.assert_close(gx[0], x2.grad)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


def test_a_checkpointed_region_is_rebuilt_once_with_its_rng() -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.d = nn.Linear(8, 8), nn.Linear(8, 8), nn.Dropout(0.5)
            self.runs = 0

        def body(self, x: torch.Tensor) -> torch.Tensor:
            self.runs += 1
            return self.b(self.d(torch.relu(self.a(x))))

    m = Drop()
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(5)
    plain = m.body(x)
    g = torch.randn_like(plain)
    plain.backward(g)
    want = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad, m.runs = None, 0
    torch.manual_seed(5)
    y = checkpoint_once(m.body, x)
    torch.randn(3)  # the RNG moves on before the backward: the rebuild replays the forward's
    gx, pending = input_grads([y], [g], [x], list(m.parameters()))
    assert m.runs == 2  # the forward and one rebuild
    weight_grads(pending)
    assert m.runs == 2  # W reads what the rebuild kept
    for got, exp in zip([p.grad for p in m.parameters()] + [gx[0]], want):
        torch.testing.assert_close(got, exp)


def test_accumulators_keep_each_parameters_node_and_follow_a_swapped_tensor() -> None:
    acc = Accumulators()
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(3))
    node = acc.of(p)
    (p * 2).sum().backward()  # a later forward reaches the very node held
    assert torch.autograd.graph.get_gradient_edge(p).node is node
    torch.utils.swap_tensors(p, q)  # p's tensor, and with it its accumulator, is another
    assert acc.of(p) is not node
    assert acc.of(p) is torch.autograd.graph.get_gradient_edge(p).node


def test_input_grads_with_kept_accumulators_equals_a_fresh_lookup() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    acc = Accumulators()
    grads = []
    for kept in (None, acc, acc):  # the second call with ``acc`` reuses its nodes
        model.zero_grad()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = model(x)
        got, pending = input_grads([y], [torch.ones_like(y)], [x], list(model.parameters()),
                                   kept)
        weight_grads(pending)
        grads.append([got[0], *(p.grad for p in model.parameters())])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert a is not None and b is not None and torch.equal(a, b)
