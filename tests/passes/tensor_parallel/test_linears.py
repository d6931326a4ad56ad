"""``passes.tensor_parallel.linears``: Hugging Face's ``Conv1D`` (``addmm`` with an ``(in, out)``
weight) is a linear in the transposed layout, sharded along the other weight dim.

With no tensor-parallel group bound the collectives are the identity, so each rank's
graph of a column -> row pair returns its partial sum plus the bias: the ranks' outputs
summed (bias counted once) equal the model's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from passes.shape_prop import shape_prop
from passes.tensor_parallel import TensorParallelism, tensor_parallel
from passes.tensor_parallel.linears import as_linear
from passes.trace import trace


class Conv1DPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.c_fc = Conv1D(12, 4)  # (nf=out, nx=in): weight (4, 12)
        self.c_proj = Conv1D(4, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


def test_conv1d_is_a_transposed_linear_and_its_shards_sum_to_the_model() -> None:
    torch.manual_seed(0)
    model = Conv1DPair()
    x = torch.randn(2, 3, 4)
    gm = shape_prop(trace(model, (x,), {}), (x,))
    found = [lin for n in gm.graph.nodes if (lin := as_linear(gm, n)) is not None]
    assert [(lin.transposed, lin.in_features, lin.out_features) for lin in found] == [
        (True, 4, 12), (True, 12, 4)]
    outs = []
    for rank in range(2):
        new, plan = tensor_parallel(gm, TensorParallelism(2, rank, True, ("c_fc", "c_proj")))
        assert plan.replicated == () and plan.pairs == (("c_fc", "c_proj"),)
        assert {s.name: s.dim for s in plan.sharded} == {
            "c_fc.weight": 1, "c_fc.bias": 0, "c_proj.weight": 0}
        assert new.state_dict()["c_fc.weight"].shape == (4, 6)
        assert new.state_dict()["c_proj.weight"].shape == (6, 4)
        outs.append(new(x))
    torch.testing.assert_close(outs[0] + outs[1] - model.c_proj.bias, model(x))


class TransposedMatmulPair(nn.Module):
    """``x @ W.T + b`` as Falcon's ``FalconLinear`` writes it; fx records ``W.T`` as a
    ``getattr`` and ``@`` as ``operator.matmul``."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(12, 4))
        self.down = nn.Parameter(torch.randn(4, 12))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.up.T) @ self.down.T + self.bias


def test_an_fx_graphs_matmul_by_a_transposed_parameter_is_a_linear() -> None:
    torch.manual_seed(0)
    model = TransposedMatmulPair()
    x = torch.randn(2, 3, 4)
    gm = shape_prop(trace(model, (x,), {}, frontend="fx"), (x,))
    assert gm.meta["smp.frontend"] == "fx"
    found = [lin for n in gm.graph.nodes if (lin := as_linear(gm, n)) is not None]
    assert [(lin.kind, lin.in_features, lin.out_features) for lin in found] == [
        ("matmul", 4, 12), ("matmul", 12, 4)]
    outs = []
    for rank in range(2):
        new, plan = tensor_parallel(gm, TensorParallelism(2, rank, True, ("",)))
        assert {s.name: s.dim for s in plan.sharded} == {"up": 0, "down": 1}
        outs.append(new(x))
    torch.testing.assert_close(outs[0] + outs[1] - model.bias, model(x))
