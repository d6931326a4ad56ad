"""``smp.write_measurement``: after a few steps of a real (in-process, two-stage) run, the
file holds the configuration in the planner's terms and each pipeline rank's forward and
backward from the flight record; before any step it is one error naming the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import smp_fx as smp
from cost_model.measurement import Measurement
from tests.helpers.numerics import init
from tests.smp_fx.planner.conftest import gpt_inputs, tiny_gpt


@smp.step
def _train(model: Any, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
    model.backward(loss)
    return loss


def test_a_run_writes_its_measurement(one_thread: None, tmp_path: Path) -> None:
    init(2, 2, "interleaved")
    net = tiny_gpt(n_layer=2)
    smp.set_activation_checkpointing(net.h[0])
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(net.parameters(), lr=1e-3))
    with pytest.raises(smp.SMPConfigError, match="smp.write_measurement"):
        smp.write_measurement(tmp_path / "early.json")
    (ids,) = gpt_inputs(4)
    for _ in range(4):
        opt.zero_grad()
        _train(model, ids, ids.roll(-1, 1))
        opt.step()
    got = smp.write_measurement(tmp_path / "m.json")
    assert Measurement.load(tmp_path / "m.json") == got
    c = got.config
    assert (c.world, c.pp, c.tp, c.dp, c.mbs, c.microbatches) == (1, 2, 1, 1, 2, 2)
    assert (c.schedule, c.recompute, c.precision, c.device) == ("interleaved", "full",
                                                                 "fp32", "cpu")
    assert got.steps == 2 and got.step_time_s > 0
    assert all(t > 0 for t in got.by_pp_rank("F")) and all(t > 0 for t in got.by_pp_rank("B"))
