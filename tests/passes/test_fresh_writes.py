"""passes.fresh_writes: a write into a tensor autograd saved trains once captured.

``MaskedSoftmax`` is transformers 4.46 DeBERTa-v2's ``XSoftmax``: a custom
``autograd.Function`` whose forward writes ``masked_fill_`` into its softmax output. Export
inlines the forward and drops the custom backward, so torch's softmax backward would read
the written output; captured, the write is out-of-place and the gradients equal eager.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from passes.trace import trace


class MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = x.masked_fill(~mask, torch.finfo(x.dtype).min).softmax(-1)
        out.masked_fill_(~mask, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (out,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, -1, out.dtype), None


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(h).chunk(2, -1)
        mask = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).tril()
        probs = MaskedSoftmax.apply(q @ k.transpose(-1, -2), mask)
        kept = torch.zeros(h.shape, dtype=torch.float32)
        kept.add_(h.double())  # out-of-place would promote to float64: stays in place
        return probs @ h + kept


def _targets(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_the_captured_write_trains_as_eager() -> None:
    torch.manual_seed(0)
    model = Attention()
    h = torch.randn(2, 5, 8)
    gm = trace(model, (h,), frontend="export")
    assert "aten.masked_fill_.Scalar" not in _targets(gm)
    assert "aten.add_.Tensor" in _targets(gm)
    model(h).square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()  # the capture may share the parameters
    out = gm(h)
    torch.testing.assert_close(out, model(h), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    got = dict(gm.named_parameters())
    for name, grad in want.items():
        torch.testing.assert_close(got[name].grad, grad, rtol=1e-5, atol=1e-5, msg=name)
