"""A tensor-parallel shard's GEMMs priced with their own waves (``passes.reprice_gemms``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from cost_model.devices import get_device
from cost_model.gpu_specs import H100_SXM
from cost_model.waves import Gemm, gemm_factors
from passes import meta
from passes.annotate_costs import annotate_costs
from passes.reprice_gemms import reprice_gemms
from passes.shape_prop import shape_prop
from passes.tensor_parallel import TensorParallelism, tensor_parallel
from passes.trace import trace

SMALL = dataclasses.replace(H100_SXM, sm_count=4, gemm_tile=(2, 2))
"""Four SMs of 2 x 2 tiles: the test MLP's shards fill fractional waves."""


def _sharded(spec: object) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16))
    x = torch.randn(6, 16)
    gm = annotate_costs(shape_prop(trace(model, (x,), {}), (x,)), spec)  # type: ignore[arg-type]
    sharded, _ = tensor_parallel(gm, TensorParallelism(2, 0, True, ("",)))
    return gm, sharded


def _gemms(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {meta.TP.get(n): n for n in gm.graph.nodes if meta.GEMM.has(n)}


def test_the_rewrite_records_the_shard_each_rank_runs() -> None:
    traced, sharded = _sharded(SMALL)
    assert [meta.GEMM.get(n) for n in traced.graph.nodes if meta.GEMM.has(n)] == [
        (Gemm(6, 16, 24), Gemm(6, 16, 24)), (Gemm(6, 24, 16), Gemm(6, 24, 16))]
    found = _gemms(sharded)
    assert meta.GEMM.get(found["col"]) == (Gemm(6, 16, 24), Gemm(6, 16, 12))
    assert meta.GEMM.get(found["row"]) == (Gemm(6, 24, 16), Gemm(6, 12, 16))


def test_each_shard_is_priced_with_its_own_waves() -> None:
    _, sharded = _sharded(SMALL)
    before = {role: meta.COST.get(n) for role, n in _gemms(sharded).items()}
    out = reprice_gemms(sharded, SMALL)
    for role, node in _gemms(out).items():
        priced, runs = meta.GEMM.get(node)
        assert priced == runs
        full = meta.GEMM.get(_gemms(sharded)[role])[0]
        (pf, pb), (rf, rb) = gemm_factors(full, SMALL), gemm_factors(runs, SMALL)
        cost = meta.COST.get(node)
        assert cost.fwd_time_s == pytest.approx(before[role].fwd_time_s * pf / rf)
        assert cost.bwd_time_s == pytest.approx(before[role].bwd_time_s * pb / rb)
    # the column shard: 3 x 6 = 18 output tiles on 4 SMs (4.5 waves) where the whole
    # linear's 36 filled 9: slower than the division by the degree alone
    col = _gemms(out)["col"]
    assert meta.COST.get(col).fwd_time_s > before["col"].fwd_time_s
    assert meta.GEMM.get(_gemms(sharded)["col"])[1] == Gemm(6, 16, 12)  # input untouched


def test_a_spec_without_sm_count_keeps_the_divided_times() -> None:
    spec = get_device("a100")
    _, sharded = _sharded(spec)
    out = reprice_gemms(sharded, spec)
    for role, node in _gemms(out).items():
        assert meta.COST.get(node) == meta.COST.get(_gemms(sharded)[role])
