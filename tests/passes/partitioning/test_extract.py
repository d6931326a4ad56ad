"""problem_from_graph: parameters are tensors, not names (tied weights counted once)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from passes.partition_config import PartitionConfig
from passes.partitioning.extract import problem_from_graph
from passes.partitioning.problem import evaluate, make_objective
from passes.pipeline import compile_model
from tests.helpers.models import example


def test_tied_gpt_parameters_counted_once() -> None:
    # wte.weight and lm_head.weight are one tensor: counted by name it would be charged
    # twice to the memory normaliser M and to a stage reading both names.
    torch.manual_seed(0)
    gpt = example("gpt")
    model = gpt.build_model()
    assert model.lm_head.weight is model.wte.weight
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    unique += sum(b.numel() * b.element_size() for b in model.buffers())
    cfg = PartitionConfig(num_stages=1, microbatches=2)
    compiled = compile_model(model, gpt.example_inputs(2), None, cfg)
    problem = problem_from_graph(compiled.gm)
    assert float(problem.param_bytes.sum()) == unique
    tied = [a for a in problem.param_aliases if len(a) > 1]
    assert tied == [("wte.weight", "lm_head.weight")]
    obj = make_objective(problem, cfg)
    factor = 2.0 + cfg.optimizer_state_factor
    saved = float(problem.saved.sum()) * min(cfg.microbatches, cfg.active)
    assert obj.memory_total == pytest.approx(factor * unique + saved)
    # one stage reads both names: its parameters are the unique bytes, as in the plan
    ev = evaluate(problem, np.zeros(problem.n, dtype=np.int64), obj)
    assert ev.param_bytes[0] == unique
    mem = compiled.plan.stages[0].memory
    assert mem.params + mem.buffers == unique
