"""Plans at tensor-parallel degree 2 (``passes.tensor_parallel.costs``): one rank's work and bytes.

The rank-0 graph of the tensor-parallel rewrite is what the plan is built on: sharded
parameters count 1/tp of their bytes, split work 1/tp of its FLOPs, and every collective
costs link time. Golden plans (a100, exact) for a marked MLP and the tiny HF Llama with its
SwiGLU MLPs marked; ``SMP_FX_UPDATE_GOLDEN=1`` rewrites them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from cost_model import roofline
from cost_model.devices import load_device
from passes import meta
from passes.partition_config import PartitionConfig
from passes.pipeline import compile_model
from passes.tensor_parallel import TensorParallelism
from passes.tensor_parallel import costs as tp_costs
from smp_fx.marking.tensor_parallelism import marked_paths
from tests.helpers.models import example
from tests.passes.test_plan_golden import GOLDEN, _check

SPEC = load_device("a100")


class Block(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, 64)]
    with smp.tensor_parallelism():
        layers += [Block(64) for _ in range(4)]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def _llama() -> nn.Module:
    llama = example("hf_llama").build_model()
    for path, module in llama.named_modules():
        if path.endswith(".mlp"):
            smp.set_tensor_parallelism(module)
    return llama


def _compile(model: nn.Module, args: tuple[Any, ...], tp: int) -> Any:
    cfg = PartitionConfig(num_stages=2, microbatches=4, pipeline="interleaved", device="a100")
    return compile_model(model, args, None, cfg, device=SPEC,
                         tp=TensorParallelism(tp, 0, True, marked_paths(model)))


@pytest.fixture(scope="module")
def mlp_plans() -> dict[int, Any]:
    model, x = _mlp(), torch.randn(2, 32)
    return {tp: _compile(model, (x,), tp) for tp in (1, 2)}


def test_parameter_bytes_are_sharded_over_tp_plus_replicated(mlp_plans: dict[int, Any]) -> None:
    full = dict(_mlp().named_parameters())
    compiled = mlp_plans[2]
    sharded = {s.name for s in compiled.tp_plan.sharded}
    assert sharded == {f"{i}.{fc}.{k}" for i in range(1, 5) for fc in ("fc1", "fc2")
                       for k in ("weight", "bias")} - {f"{i}.fc2.bias" for i in range(1, 5)}
    want = sum(p.numel() * 4 // (2 if n in sharded else 1) for n, p in full.items())
    assert sum(st.param_bytes for st in compiled.plan.stages) == want
    assert sum(st.param_bytes for st in mlp_plans[1].plan.stages) == sum(
        p.numel() * 4 for p in full.values())


def test_split_work_is_divided_and_collectives_cost_link_time(
        mlp_plans: dict[int, Any]) -> None:
    one, two = mlp_plans[1], mlp_plans[2]
    flops = [sum(st.flops for st in c.plan.stages) for c in (one, two)]
    assert flops[0] / 2 < flops[1] < flops[0] * 0.6  # the blocks are most of the work
    priced = {}
    for n in two.gm.graph.nodes:
        kind = meta.TP.get(n)
        if kind in tp_costs.COLLECTIVES:
            cost, info = meta.COST.get(n), meta.TENSOR.get(n)
            fwd_kind, bwd_kind = tp_costs.COLLECTIVES[kind]
            assert cost.fwd_time_s == pytest.approx(tp_costs.collective_time(
                fwd_kind, info.nbytes, 2, lambda b: roofline.comm_time(b, SPEC)))
            assert cost.bwd_time_s == pytest.approx(tp_costs.collective_time(
                bwd_kind, info.nbytes, 2, lambda b: roofline.comm_time(b, SPEC)))
            priced[kind] = cost
    assert set(priced) == {"tp_copy", "tp_reduce"}  # prescaled: no batch gathers
    assert priced["tp_reduce"].fwd_time_s > 0 and priced["tp_copy"].bwd_time_s > 0
    assert two.tp_plan.pairs == tuple((f"{i}.fc1", f"{i}.fc2") for i in range(1, 5))


def _golden(compiled: Any) -> str:
    return json.dumps({"plan": compiled.plan.to_json(),
                       "tensor_parallel": compiled.tp_plan.to_json()},
                      sort_keys=True, indent=1) + "\n"


def test_golden_plan_mlp_tp2(mlp_plans: dict[int, Any]) -> None:
    _check(_golden(mlp_plans[2]), GOLDEN / "plan_tp_mlp_p2_tp2.json")


def test_golden_plan_llama_mlps_tp2() -> None:
    ex = example("hf_llama")
    model = _llama()
    torch.manual_seed(0)
    args = tuple(a[:2] for a in ex.example_inputs(8))
    compiled = _compile(model, args, 2)
    layers = sum(1 for p, _ in model.named_modules() if p.endswith(".mlp"))
    assert layers > 0 and len(compiled.tp_plan.sharded) == 3 * layers  # gate, up, down
    _check(_golden(compiled), GOLDEN / "plan_tp_llama_mlp_p2_tp2.json")
