"""SMP's private modules that AWS's example helpers import resolve, under the shims, to
smp-fx's own answers (``smp_fx._compat.private``)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import smp_fx as smp
from smp_fx.world import state
from tests.helpers.numerics import init
from tests.helpers.shims import shims as shims_active


@pytest.fixture()
def shims() -> Iterator[None]:
    try:
        with shims_active():
            yield
    finally:
        state._reset()


def test_the_examples_private_imports(shims: None) -> None:
    """The import lines of AWS's fp16 helpers and BERT scripts, verbatim."""
    scope: dict[str, Any] = {}
    exec("import smdistributed.modelparallel.torch as smp\n"  # noqa: S102 - their lines
         "from smdistributed.modelparallel.torch.state_mod import state as smp_state\n"
         "from smdistributed.modelparallel.torch.utils import get_distribution_axis\n"
         "from smdistributed.modelparallel.torch.utils import rmsg\n"
         "from smdistributed.modelparallel.test.torch.utils import dump_model, verify\n",
         scope)
    assert scope["smp"] is smp
    private = importlib.import_module("smp_fx._compat.private.utils")
    assert scope["get_distribution_axis"] is private.get_distribution_axis
    assert scope["rmsg"]("hello") == "hello"  # before smp.init: the message alone
    with pytest.raises(smp.SMPNotImplementedError, match="assert_close"):
        scope["verify"]()
    init(1, 1, "simple")
    assert scope["rmsg"]("hello") == "[rank 0 pp 0 tp 0 rdp 0] hello"
    assert scope["smp_state"].cfg.pipeline_parallel_degree == 1  # smp.state's attributes


def test_state_mod_parameter_maps_and_distribution_axis(shims: None) -> None:
    import smdistributed.modelparallel.torch.state_mod as state_mod
    import smdistributed.modelparallel.torch.utils as utils

    init(2, 2, "simple")
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))

    @smp.step
    def fwd(model: Any, x: torch.Tensor) -> Any:
        return model(x)

    with torch.no_grad():
        fwd(model, torch.randn(4, 4))
    [by_index] = state_mod.state.param_index_to_name_tp_group
    assert by_index == {0: "0.weight", 1: "0.bias", 2: "2.weight", 3: "2.bias"}
    assert state_mod.state.param_name_to_index_tp_group == [
        {n: i for i, n in by_index.items()}]
    assert set(opt._param_id_to_index().values()) == set(by_index)
    assert utils.get_distribution_axis(net[0].weight) is None  # tp=1: every one is whole
