"""FP8 linears (``passes.fp8_linears``): which GEMMs are marked, and what the mark costs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cost_model.errors import SMPConfigError
from cost_model.gpu_specs import A100_80GB, H100_SXM
from cost_model.roofline import FP8_CAST_BYTES, fp8_cast_times
from passes import meta
from passes.annotate_costs import annotate_costs, op_name
from passes.fp8_linears import FP8, mark_fp8_linears
from passes.shape_prop import shape_prop
from passes.trace import trace
from smp_fx.planner.layers import find_repeats, tidy
from tests.smp_fx.planner.conftest import gpt_inputs, tiny_gpt

SLOW_MATH = dataclasses.replace(H100_SXM, sm_count=0, gemm_tile=(), matmul_shapes="",
                                matmul_efficiency=((1.0, 0.5),), peak_flops_bf16=2e9,
                                peak_flops_fp8=4e9)
"""No waves, one GEMM efficiency, math slow enough that every GEMM is compute-bound: an
FP8 GEMM's time is its FLOPs over half the FP8 peak."""


def _graph() -> tuple[torch.fx.GraphModule, str]:
    model = tiny_gpt(3).to(torch.bfloat16)
    x = gpt_inputs(2)
    gm = tidy(trace(model, x, {}))
    repeats = find_repeats(gm)
    assert repeats is not None
    return shape_prop(gm, x), repeats.parent


def _linears(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if op_name(n, gm) == "linear" and meta.PARAMS.get(n)]


def test_the_layers_linears_are_marked_and_nothing_else() -> None:
    gm, parent = _graph()
    out = mark_fp8_linears(gm, parent)
    marked = [n for n in out.graph.nodes if meta.GEMM_DTYPE.get(n) == FP8]
    inside = [n for n in _linears(out)
              if (meta.MODULE_PATH.get(n) or "").startswith(parent + ".")]
    assert marked == inside and len(marked) == 3 * 4  # qkv, proj, fc, proj per layer
    assert out.meta["smp.fp8_linears"] == 12
    assert len(_linears(out)) > len(marked)  # the LM head stays in bf16
    assert not any(meta.GEMM_DTYPE.has(n) for n in gm.graph.nodes)  # its input untouched
    every = mark_fp8_linears(gm, "")
    assert every.meta["smp.fp8_linears"] == len(_linears(gm))


def test_an_fp8_linear_is_priced_at_the_fp8_peak_plus_its_casts() -> None:
    gm, parent = _graph()
    plain = annotate_costs(gm, SLOW_MATH)
    fp8 = annotate_costs(mark_fp8_linears(gm, parent), SLOW_MATH)
    priced = 0
    for a, b in zip(plain.graph.nodes, fp8.graph.nodes, strict=True):
        ca, cb = meta.COST.get(a), meta.COST.get(b)
        if not meta.GEMM_DTYPE.has(b):
            assert (cb.fwd_time_s, cb.bwd_time_s) == (ca.fwd_time_s, ca.bwd_time_s)
            continue
        x_elems = math.prod(meta.TENSOR.get(b.args[0]).shape)
        y_elems = math.prod(meta.TENSOR.get(b).shape)
        cast_f, cast_b = fp8_cast_times(x_elems, y_elems, SLOW_MATH)
        assert cast_f == pytest.approx(
            FP8_CAST_BYTES * x_elems / SLOW_MATH.bandwidth(FP8_CAST_BYTES * x_elems))
        assert ca.fwd_time_s == pytest.approx(ca.fwd_flops / (0.5 * 2e9), rel=1e-12)
        assert cb.fwd_time_s == pytest.approx(cb.fwd_flops / (0.5 * 4e9) + cast_f, rel=1e-12)
        assert cb.bwd_time_s == pytest.approx(cb.bwd_flops / (0.5 * 4e9) + cast_b, rel=1e-12)
        priced += 1
    assert priced == 12


def test_a_gpu_without_fp8_tensor_cores_says_so() -> None:
    assert H100_SXM.peak_flops("float8") == 1979e12
    with pytest.raises(SMPConfigError, match="FP8 GEMMs need FP8 tensor cores"):
        A100_80GB.peak_flops("float8")
    gm, parent = _graph()
    with pytest.raises(SMPConfigError, match="peak_flops_fp8"):
        annotate_costs(mark_fp8_linears(gm, parent), A100_80GB)


def test_an_input_several_fp8_linears_read_is_cast_once() -> None:
    class QK(torch.nn.Module):  # two projections of one input, as q, k and v are
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) + self.k(x)

    x = torch.randn(32, 64, dtype=torch.bfloat16)
    gm = shape_prop(trace(QK().to(torch.bfloat16), (x,), {}), (x,))
    out = annotate_costs(mark_fp8_linears(gm, ""), SLOW_MATH)
    q, k = (n for n in out.graph.nodes if meta.GEMM_DTYPE.has(n))
    cast_f, cast_b = fp8_cast_times(32 * 64, 32 * 64, SLOW_MATH)
    gemm = meta.COST.get(q).fwd_flops / (0.5 * 4e9)
    assert meta.COST.get(q).fwd_time_s == pytest.approx(gemm + cast_f, rel=1e-12)
    assert meta.COST.get(k).fwd_time_s == pytest.approx(gemm, rel=1e-12)  # already cast
    assert meta.COST.get(k).bwd_time_s == pytest.approx(meta.COST.get(q).bwd_time_s)
