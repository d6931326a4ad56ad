"""``compile_model``: the passes in order, pure, manual vs auto, devices, baselines."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cost_model.devices import get_device
from cost_model.errors import SMPConfigError, SMPPartitionError
from passes import meta
from passes.partition_config import PartitionConfig
from passes.pipeline import analyse, baseline_plans, compile_model, partition
from passes.trace import trace


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def test_passes_run_in_order_and_stage_every_node() -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen: list[str] = []
    compiled = compile_model(model, (torch.randn(2, 8),), None,
                             PartitionConfig(num_stages=2, microbatches=2), progress=seen.append)
    assert seen == ["trace", "shape_prop", "annotate_costs", "auto_partition", "build_plan"]
    assert all(meta.STAGE.has(n) for n in compiled.gm.graph.nodes)
    assert {meta.STAGE.get(n) for n in compiled.gm.graph.nodes} == {0, 1}
    assert compiled.plan.device["name"] == "a100" and compiled.device == get_device("a100")
    assert compiled.plan.strategy != "manual"
    # the user's model is only read
    assert "forward" not in vars(model) and "__call__" not in vars(model)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])
    torch.testing.assert_close(compiled.gm(torch.ones(2, 8)), model(torch.ones(2, 8)))


def test_one_costed_graph_many_configs() -> None:
    costed = analyse(_model(), (torch.randn(2, 8),), device="v100")
    assert not any(meta.STAGE.has(n) for n in costed.graph.nodes)
    plans = [partition(costed, PartitionConfig(num_stages=k, memory_weight=w),
                       device="v100").plan for k in (1, 2, 3) for w in (0.0, 1.0)]
    assert [len(p.stages) for p in plans] == [1, 1, 2, 2, 3, 3]
    assert not any(meta.STAGE.has(n) for n in costed.graph.nodes)  # input untouched
    assert plans[0].objective == pytest.approx(1.0)  # one stage holds everything


def test_manual_pins_apply_only_without_auto_partition() -> None:
    pins = {"0": 1, "2": 1}  # later modules default to 1 too; "0" is the first Linear
    cfg = PartitionConfig(num_stages=2, auto_partition=False, default_partition=1)
    compiled = compile_model(_model(), (torch.randn(2, 8),), None, cfg, pins=pins)
    assert compiled.plan.strategy == "manual"
    assert {meta.STAGE.get(n) for n in compiled.gm.graph.nodes if n.op == "call_module"} == {1}
    with pytest.raises(SMPPartitionError, match="below the number of partitions"):
        compile_model(_model(), (torch.randn(2, 8),), None, cfg, pins={"0": 5})


class _KwargsAndDict(nn.Module):
    """Keyword input and dict output: export's pytree codegen carries that structure."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x).relu()
        return {"out": self.b(h) * scale, "h": h}


@pytest.mark.parametrize("auto", [True, False])
def test_a_given_trace_is_planned_with_its_codegen_and_meta(auto: bool) -> None:
    model = _KwargsAndDict()
    x, scale = torch.randn(2, 4), torch.full((2, 1), 3.0)
    traced = trace(model, (x,), {"scale": scale}, frontend="export")
    seen: list[str] = []
    compiled = compile_model(model, (x,), {"scale": scale},
                             PartitionConfig(num_stages=2, auto_partition=auto), pins={"b": 1},
                             traced=traced, progress=seen.append)
    assert seen[0] == "shape_prop"  # no second trace
    assert [n.name for n in compiled.gm.graph.nodes] == [n.name for n in traced.graph.nodes]
    assert compiled.gm.meta["smp.frontend"] == "export"
    assert not any(meta.STAGE.has(n) for n in traced.graph.nodes)  # input untouched
    out, want = compiled.gm(x, scale=scale), model(x, scale=scale)
    assert out.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(out[key], want[key])


def test_unknown_device_is_a_config_error() -> None:
    with pytest.raises(SMPConfigError, match="built-in name or a JSON file"):
        compile_model(_model(), (torch.randn(2, 8),), None, PartitionConfig(num_stages=2),
                      device="tpu9")


def test_baselines_are_scored_by_the_same_objective() -> None:
    compiled = compile_model(_model(), (torch.randn(4, 8),), None,
                             PartitionConfig(num_stages=2, memory_weight=0.5))
    results = baseline_plans(compiled)
    assert [r.name for r in results] == ["uniform_layers", "parameter_balanced",
                                         "block_partition", "module_tree"]
    for r in results:
        assert r.plan is not None, r.error
        assert r.plan.strategy == r.name
        assert r.plan.lower_bound == compiled.plan.lower_bound
        assert compiled.plan.objective <= r.plan.objective + 1e-9
