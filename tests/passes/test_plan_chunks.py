"""Plans with several chunks per rank or a split backward: placement, per-rank memory,
the weight gradient's share, and the errors for models too small for their chunks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cost_model.errors import SMPConfigError
from cost_model.schedule import round_robin, v_shape
from passes.partition_config import PartitionConfig
from passes.pipeline import compile_model
from passes.plan import PartitionPlan


def _mlp(n: int = 8, width: int = 32) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)])


def _plan(pipeline: str, v: int, p: int = 2, m: int = 4, model: nn.Module | None = None
          ) -> PartitionPlan:
    cfg = PartitionConfig(num_stages=p, microbatches=m, pipeline=pipeline, virtual_stages=v)
    return compile_model(model or _mlp(), (torch.randn(8, 32),), None, cfg).plan


@pytest.mark.parametrize(("pipeline", "v"), [("simple", 2), ("interleaved", 2),
                                             ("zero_bubble", 2), ("zbv", 2), ("interleaved", 3)])
def test_chunks_are_contiguous_and_placed(pipeline: str, v: int) -> None:
    plan = _plan(pipeline, v)
    assert len(plan.stages) == 2 * v
    assert plan.placement == (v_shape(2) if pipeline == "zbv" else round_robin(2, v))
    layers = [int(path.split(".")[0]) for st in plan.stages for path in st.module_paths]
    assert layers == sorted(layers) and set(layers) == set(range(8))  # model order
    assert [r.chunks for r in plan.ranks] == [
        tuple(c for c, r in enumerate(plan.placement) if r == rank) for rank in range(2)]
    for rank in plan.ranks:
        chunk_static = sum(plan.stages[c].memory.params + plan.stages[c].memory.grads
                           + plan.stages[c].memory.optimizer_state for c in rank.chunks)
        assert rank.static == chunk_static and rank.total >= rank.static + rank.activations
    assert PartitionPlan.loads(plan.dumps()) == plan


def test_the_v_keeps_its_turn_on_one_rank() -> None:
    plan = _plan("zbv", 2, p=2)
    # chunk 1 -> chunk 2 both on rank 1: no link; the others cross ranks
    assert [st.link_time_s > 0 for st in plan.stages] == [True, False, True, False]


def test_split_backward_carries_the_weight_gradient() -> None:
    whole, split = _plan("interleaved", 1), _plan("zero_bubble", 1)
    for st in split.stages:
        assert 0 < st.wgrad_time_s < st.bwd_time_s
        # the kept graph: every saved activation, plus the gradients recorded at the joins
        assert st.memory.pending_w_per_microbatch > st.memory.activations_per_microbatch
    assert all(st.wgrad_time_s == 0 for st in whole.stages) and not whole.ranks
    # zero bubble: a shorter pipeline than 1F1B on the same cut
    assert split.pipeline_time_s < whole.pipeline_time_s
    assert 0 < split.bubble_rate < 1


def test_more_chunks_than_layers_say_which_degree_fits() -> None:
    with pytest.raises(SMPConfigError, match="cuts the model into 8 chunks.*"
                       "virtual_pipeline_degree to 1 or less"):
        _plan("interleaved", 4, p=2, model=nn.Sequential(nn.Linear(32, 32), nn.ReLU(),
                                                         nn.Linear(32, 32)))


def test_interleaving_lowers_the_predicted_bubble() -> None:
    one, two = _plan("interleaved", 1, m=8), _plan("interleaved", 2, m=8)
    assert two.bubble_fraction < one.bubble_fraction
