"""The planner's part prices are the compiler's: the same node costs, saved bytes and
tensor-parallel collectives as ``compile_model`` (what ``smp-fx partition`` and
``DistributedModel`` plan with), summed per part."""

from __future__ import annotations

import pytest

from passes.partition_config import PartitionConfig
from passes.pipeline import compile_model
from passes.tensor_parallel import TensorParallelism
from smp_fx.planner.model import Profiler, prepare
from tests.smp_fx.planner.conftest import gpt_inputs, link_cluster, tiny_gpt


def _totals(prof):  # sums over the whole model (layers expanded)
    units = prof.units()
    return (sum(u.fwd_s for u in units), sum(u.bwd_s for u in units),
            sum(u.saved for u in units), sum(u.param_elems for u in units)
            + sum(dict(s for u in units for s in u.shared).values()))


@pytest.mark.parametrize("mbs", [1, 3])
def test_one_cost_model_at_tp1(mbs: int) -> None:
    model = tiny_gpt(5)
    cluster = link_cluster()
    plan = compile_model(model, gpt_inputs(mbs), None, PartitionConfig(num_stages=1),
                         device=cluster.device).plan
    prof = Profiler(prepare(model, gpt_inputs), cluster)(mbs, 1, False)
    fwd, bwd, saved, elems = _totals(prof)
    stage = plan.stages[0]
    assert fwd == pytest.approx(stage.fwd_time_s, rel=1e-9)
    assert bwd == pytest.approx(stage.bwd_time_s, rel=1e-9)
    assert saved == stage.memory.activations_per_microbatch
    assert elems * 4 == stage.memory.params
    assert prof.layers == 5 and prof.repeat == (2, 4)


@pytest.mark.parametrize("sp", [False, True])
def test_one_cost_model_at_tp2(sp: bool) -> None:
    model = tiny_gpt(4)
    cluster = link_cluster()
    tp = TensorParallelism(2, 0, True, ("",), sp)
    plan = compile_model(model, gpt_inputs(2), None, PartitionConfig(num_stages=1),
                         device=cluster.device, tp=tp).plan
    prof = Profiler(prepare(model, gpt_inputs), cluster)(2, 2, sp)
    fwd, bwd, saved, elems = _totals(prof)
    stage = plan.stages[0]
    assert not prof.replicated
    assert fwd == pytest.approx(stage.fwd_time_s, rel=1e-9)
    assert bwd == pytest.approx(stage.bwd_time_s, rel=1e-9)
    assert saved == stage.memory.activations_per_microbatch
    assert elems * 4 == stage.memory.params
    # the collectives are in the times, and counted apart
    assert sum(u.tp_fwd_s + u.tp_bwd_s for u in prof.units()) > 0


def test_recompute_modes_keep_less() -> None:
    prof = Profiler(prepare(tiny_gpt(4), gpt_inputs), link_cluster())(4, 1, False)
    layer = prof.parts[2]
    assert layer.saved_full < layer.saved_selective <= layer.saved
    assert layer.transient_full > 0
    f, b = layer.times("full")
    assert b == pytest.approx(layer.bwd_s + layer.fwd_s)
    assert layer.times("selective")[1] == pytest.approx(layer.bwd_s + layer.selective_fwd_s)
    assert 0 < layer.selective_fwd_s < layer.fwd_s
    assert prof.parts[0].saved_full == prof.parts[0].saved  # the head is never recomputed
    # a weight gradient is half of each linear's backward
    assert 0 < layer.wgrad_s < layer.bwd_s


def test_tied_embedding_is_shared_between_head_and_tail() -> None:
    prof = Profiler(prepare(tiny_gpt(4), gpt_inputs), link_cluster())(1, 1, False)
    head, tail = prof.parts[0], prof.parts[-1]
    assert dict(head.shared) == dict(tail.shared) == {"wte.weight": 64 * 32}
    assert prof.output_bytes == 16 * 64 * 4
