"""``PartitionPlan``: hand-checked numbers on a tiny staged graph, JSON round trip, errors.

The graph here is built by hand (symbolic_trace + the ``smp.*`` keys set directly) so the
plan is tested on its own inputs, independent of the front end and the partitioner.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from cost_model.devices import A100, DEFAULT_DEVICE, get_device
from cost_model.errors import SMPPartitionError
from cost_model.node_cost import NodeCost
from cost_model.schedule import generate
from cost_model.simulate import simulate
from passes import meta
from passes.partition_config import PartitionConfig
from passes.plan import PartitionPlan, build_plan, summarise_modules


@dataclass(frozen=True)
class _Info:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


class Tied(nn.Module):
    """Embedding tied to the head, four Linear layers: a two-stage GPT in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.layers(self.emb(x))))


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) + y


def staged(stage_of: Callable[[int, torch.fx.Node], int], model: nn.Module | None = None,
           example: torch.Tensor | None = None) -> torch.fx.GraphModule:
    """Trace ``Tied``; compute node i costs i ms forward, 2i ms backward, saves 16 i bytes."""
    gm = torch.fx.symbolic_trace(model or Tied())
    ShapeProp(gm).propagate(torch.randint(0, 10, (2, 3)) if example is None else example)
    mods = dict(gm.named_modules())
    for i, n in enumerate(gm.graph.nodes):
        tm = n.meta.get("tensor_meta")
        if tm is not None:
            meta.TENSOR.set(n, _Info(tuple(tm.shape), "float32", tm.shape.numel() * 4))
        path = n.target if n.op == "call_module" else ""
        meta.MODULE_PATH.set(n, path)
        if n.op == "call_module":
            meta.PARAMS.set(n, tuple(f"{path}.{k}" for k, _ in mods[path].named_parameters()))
        if n.op in ("call_module", "call_function", "call_method"):
            out = meta.TENSOR.get(n).nbytes
            meta.COST.set(n, NodeCost(fwd_flops=100.0 * i, bwd_flops=200.0 * i,
                                      fwd_time_s=1e-3 * i, bwd_time_s=2e-3 * i,
                                      saved_bytes=16 * i, output_bytes=out))
        meta.STAGE.set(n, stage_of(i, n))
    return gm


@pytest.fixture(scope="module")
def two_stage() -> torch.fx.GraphModule:
    # nodes: 0 x, 1 emb, 2 layers_0, 3 layers_1 | 4 layers_2, 5 layers_3, 6 relu, 7 head, 8 out
    return staged(lambda i, n: 0 if i < 4 else 1)


def test_stage_contents_by_hand(two_stage: torch.fx.GraphModule) -> None:
    plan = build_plan(two_stage, PartitionConfig(num_stages=2, microbatches=4))
    s0, s1 = plan.stages
    assert s0.nodes == ("x", "emb", "layers_0", "layers_1")
    assert s1.nodes == ("layers_2", "layers_3", "relu", "head", "output")
    assert s0.modules == ("emb", "layers.[0-1]") and s1.modules == ("layers.[2-3]", "head")
    assert s1.params[-1] == "head.weight"
    # 320 B embedding (tied with the head, so on both stages) + two 288 B Linear layers
    assert s0.param_bytes == s1.param_bytes == 320 + 2 * 288
    # Adam: two fp32 moments per element and a 4 B step counter per tensor (5 tensors)
    assert (s0.memory.grads, s0.memory.optimizer_state) == (896, 1792 + 5 * 4)
    # interleaved, p=2, m=4: stage 0 holds 2 microbatches, stage 1 one
    assert (s0.memory.in_flight, s1.memory.in_flight) == (2, 1)
    assert s0.memory.activations_per_microbatch == 16 * (0 + 1 + 2 + 3)
    assert s0.memory.total == 896 * 4 + 5 * 4 + 96 * 2
    assert s0.fwd_flops == 600.0 and s1.bwd_flops == 2 * 100.0 * (4 + 5 + 6 + 7)
    assert s0.fwd_time_s == pytest.approx(6e-3) and s1.bwd_time_s == pytest.approx(44e-3)
    (sent,) = s0.sent
    assert (sent.value, sent.shape, sent.nbytes, sent.consumers) == ("layers_1", (2, 3, 8),
                                                                      192, (1,))
    assert s1.received == (sent,) and s1.sent == ()
    spec = get_device(DEFAULT_DEVICE)  # the link model is the device spec's
    assert plan.spec().name == spec.name and plan.spec().op_overheads == spec.op_overheads
    assert s0.comm_time_s == pytest.approx(spec.link_latency_s + 192 / spec.link_bandwidth)
    assert s0.link_time_s == pytest.approx(192 / spec.link_bandwidth)
    assert s1.comm_time_s == s1.link_time_s == 0.0
    # sends overlap compute: a stage is busy for the larger of the two per microbatch
    assert s0.time_s == pytest.approx(max(18e-3, s0.link_time_s))
    assert plan.stage_costs()[1].latency_s == pytest.approx(spec.link_latency_s)


def test_shared_params_and_objective(two_stage: torch.fx.GraphModule) -> None:
    plan = build_plan(two_stage, PartitionConfig(num_stages=2, microbatches=4))
    (shared,) = plan.shared_params
    assert shared.names == ("emb.weight", "head.weight") and shared.stages == (0, 1)
    assert shared.nbytes == 320 and "gradients summed" in shared.handling
    assert plan.objective == max(s.cost for s in plan.stages)
    assert plan.bottleneck_stage == 1
    assert 0 < plan.lower_bound <= plan.objective and plan.ratio >= 1.0
    # memory_weight 0: the costs are the time shares of the total
    timed = build_plan(two_stage, PartitionConfig(num_stages=2, microbatches=4,
                                                  memory_weight=0.0))
    assert timed.stages[1].cost == pytest.approx(66 / 84, rel=1e-9)
    assert timed.time_total_s == pytest.approx(0.084)
    assert timed.lower_bound == pytest.approx(max(1 / 2, 7 / 28), rel=1e-9)


@pytest.mark.parametrize("pipeline", ["simple", "interleaved"])
def test_step_time_comes_from_the_simulator(two_stage: torch.fx.GraphModule,
                                            pipeline: str) -> None:
    cfg = PartitionConfig(num_stages=2, microbatches=4, pipeline=pipeline)
    plan = build_plan(two_stage, cfg)
    sim = simulate(generate(pipeline, 2, 4), plan.stage_costs())
    assert plan.pipeline_time_s == pytest.approx(sim.step_time_s, rel=1e-9)
    assert plan.step_time_s == pytest.approx(plan.training_step_s(sim), rel=1e-9)
    assert plan.bubble_fraction == pytest.approx(sim.bubble_fraction, rel=1e-9)
    assert 0.0 < plan.bubble_fraction < 1.0
    assert [s.memory.total for s in plan.stages] == list(sim.peak_memory_bytes)


def test_json_round_trip_and_determinism(two_stage: torch.fx.GraphModule) -> None:
    cfg = PartitionConfig(num_stages=2, microbatches=4, pipeline="simple", memory_weight=0.2)
    plan = build_plan(two_stage, cfg)
    assert PartitionPlan.from_json(plan.to_json()) == plan
    assert PartitionPlan.loads(plan.dumps()) == plan
    assert build_plan(two_stage, cfg).dumps() == plan.dumps()
    data = json.loads(plan.dumps())
    assert list(data) == sorted(data) and data["schema_version"] == 2
    with pytest.raises(SMPPartitionError, match="schema version"):
        PartitionPlan.from_json({**data, "schema_version": 99})


def test_value_crossing_two_cuts_is_counted_on_both() -> None:
    # x, a on stage 0; b on 1; add, output on 2: a's output skips stage 1
    gm = staged(lambda i, n: (0, 0, 1, 2, 2)[i], Skip(), torch.randn(3, 4))
    spec = dataclasses.replace(A100, link_bandwidth=1.0, link_latency_s=0.0)
    s0, s1, s2 = build_plan(gm, PartitionConfig(num_stages=3), spec).stages
    assert [(b.value, b.consumers) for b in s0.sent] == [("a", (1, 2))]
    assert [b.value for b in s2.received] == ["a", "b"]
    assert (s0.comm_time_s, s1.comm_time_s) == (48.0, 96.0)  # 48 B per (3, 4) float tensor


def test_errors_name_the_node(two_stage: torch.fx.GraphModule) -> None:
    backwards = staged(lambda i, n: 1 if i < 4 else 0)
    with pytest.raises(SMPPartitionError, match="only flows to later stages.*layers_1"):
        build_plan(backwards, PartitionConfig(num_stages=2))
    missing = staged(lambda i, n: 0)
    for n in missing.graph.nodes:
        if n.name == "relu":
            del n.meta[meta.STAGE.name]
    with pytest.raises(SMPPartitionError, match="smp.stage on every node.*relu"):
        build_plan(missing, PartitionConfig(num_stages=2))
    with pytest.raises(SMPPartitionError, match=r"lies in \[0, 1\)"):
        build_plan(two_stage, PartitionConfig(num_stages=1))


def test_summarise_modules() -> None:
    paths = ["transformer.wte", "transformer.h.0.attn", "transformer.h.0.mlp",
             "transformer.h.1.ln_1", "transformer.h.2", "transformer.h.4", "lm_head"]
    assert summarise_modules(paths) == ("transformer.wte", "transformer.h.[0-2]",
                                        "transformer.h.4", "lm_head")
    assert summarise_modules(["0", "1", "2", "5"]) == ("[0-2]", "5")
    assert summarise_modules([""]) == ("<root>",)


def test_training_step_prices_optimizer_reduction_and_runtime(
        two_stage: torch.fx.GraphModule) -> None:
    """The step is the pipeline (each action + 1 ms, each message + 2 ms), then the tied
    weight's all-reduce over both stages, each stage's Adam step, and 5 ms per step."""
    spec = dataclasses.replace(A100, microbatch_overhead_s=1e-3, message_overhead_s=2e-3,
                               step_overhead_s=5e-3, optimizer_tensor_s=1e-3,
                               optimizer_byte_s=1e-6)
    plan = build_plan(two_stage, PartitionConfig(num_stages=2, microbatches=4,
                                                 pipeline="simple"), spec)
    s0, s1 = plan.stages
    # stage 0: the tied embedding (320 B) and two Linear(8, 8) (2 x 288 B), 5 tensors
    assert s0.optimizer_time_s == pytest.approx(5e-3 + 896e-6)
    assert plan.stage_costs()[0].duration("F", 1) == pytest.approx(
        s0.fwd_time_s + 1e-3 + 2e-3)  # stage 0 only sends
    sim = plan.simulate()
    ends = sim.finish_times()
    reduce_s = 2 * (spec.link_latency_s + 320 / spec.link_bandwidth + 2e-3)
    assert plan.step_time_s == pytest.approx(
        max(ends) + reduce_s + max(s0.optimizer_time_s, s1.optimizer_time_s) + 5e-3)
