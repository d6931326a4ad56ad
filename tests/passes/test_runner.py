from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from cost_model.devices import H100
from cost_model.errors import SMPPassError
from passes.annotate_costs import annotate_costs
from passes.graph_utils import copy_graph_module
from passes.meta import COST, PARAMS, TENSOR
from passes.runner import Pass, run_passes
from passes.shape_prop import shape_prop
from passes.trace import trace


def _gm() -> tuple[torch.fx.GraphModule, tuple[torch.Tensor, ...]]:
    x = torch.randn(2, 4)
    return trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (x,)), (x,)


def test_runs_checks_and_dumps(tmp_path: Path) -> None:
    gm, args = _gm()
    out = run_passes(gm, [
        ("shape_prop", lambda g: shape_prop(g, args), (PARAMS,), (TENSOR,)),
        Pass("annotate_costs", lambda g: annotate_costs(g, H100), (TENSOR, PARAMS), (COST,)),
    ], dump_dir=tmp_path, verify=True)
    assert all(COST.has(n) for n in out.graph.nodes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00_shape_prop.txt",
                                                          "01_annotate_costs.txt"]
    assert "call_module" in (tmp_path / "00_shape_prop.txt").read_text()


def test_missing_requirement_names_pass_and_history() -> None:
    gm, args = _gm()
    with pytest.raises(SMPPassError) as info:
        run_passes(gm, [("copy", copy_graph_module, (), ()),
                        ("annotate_costs", lambda g: annotate_costs(g, H100), (TENSOR,),
                         (COST,))])
    text = str(info.value)
    assert "'annotate_costs'" in text and "smp.tensor" in text and "['copy']" in text


def test_unkept_promise_and_failure_and_mutation() -> None:
    gm, _ = _gm()
    with pytest.raises(SMPPassError, match="did not provide"):
        run_passes(gm, [("noop", copy_graph_module, (), (COST,))])

    def boom(g: torch.fx.GraphModule) -> torch.fx.GraphModule:
        raise KeyError("x")

    with pytest.raises(SMPPassError, match="'boom' failed.*KeyError") as info:
        run_passes(gm, [("boom", boom, (), ())])
    assert isinstance(info.value.__cause__, KeyError)  # how a test tells a crash (refusals.py)

    def mutate(g: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for n in g.graph.nodes:
            COST.set(n, None)
        return copy_graph_module(g)

    with pytest.raises(SMPPassError, match="mutated its input"):
        run_passes(gm, [("mutate", mutate, (), ())], verify=True)

