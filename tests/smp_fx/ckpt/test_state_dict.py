"""Tests for smp_fx.ckpt.state_dict: pure merging/splitting by FQN against the plain model.

The "stages" here are simulated in-process: each holds a subset of the plain model's
parameters and its own torch optimizer over them, as a pipeline rank does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt.state_dict import (
    GROUP_PARAMS_KEY,
    PARTIAL_KEY,
    ModelLayout,
    check_model_keys,
    is_partial,
    local_model_state_dict,
    local_optimizer_state_dict,
    merge_model_state_dicts,
    merge_optimizer_state_dicts,
    merge_orders,
    merge_partial_optimizer_states,
    optimizer_state_by_name,
    optimizer_state_to_torch,
    select_model_state,
)


class Tied(nn.Module):
    """Embedding and output head share one weight; a BatchNorm gives buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact structural equality, tensors by value/dtype; dict key order included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict), path
        assert list(a.keys()) == list(b.keys()), f"{path}: {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randint(0, 7, (5,))).square().mean().backward()
        opt.step()


def plain_setup() -> tuple[Tied, torch.optim.Optimizer, list[list[str]]]:
    """A trained plain model and Adam with two param groups (names in optimizer order);
    seeded, so every rank of a multi-process test builds the same one."""
    torch.manual_seed(0)
    model = Tied()
    named = dict(model.named_parameters())  # tie appears once, as 'emb.weight'
    g0 = ["emb.weight", "body.0.weight", "body.0.bias"]
    g1 = [n for n in named if n not in g0]
    opt = torch.optim.Adam([{"params": [named[n] for n in g0]},
                            {"params": [named[n] for n in g1], "lr": 0.01}], lr=0.1)
    train(model, opt, 2)
    return model, opt, [g0, g1]


STAGES_2 = [{"emb.weight", "body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias"},
            {"body.2.weight", "body.2.bias", "emb.weight"}]  # tied weight replicated
STAGES_3 = [{"emb.weight", "body.0.weight"}, {"body.0.bias", "body.1.weight", "body.1.bias"},
            {"body.2.weight", "body.2.bias", "emb.weight"}]


def stage_names(stage: set[str], full: Sequence[Sequence[str]]) -> list[list[str]]:
    return [[n for n in g if n in stage] for g in full]


def make_stage_optimizers(model: nn.Module, full: list[list[str]], stages: list[set[str]],
                          plain_sd: dict[str, Any]) -> list[torch.optim.Optimizer]:
    """One local Adam per stage over its parameters, loaded from the full plain state."""
    named = dict(model.named_parameters())
    by_name = optimizer_state_by_name(plain_sd, full)
    opts = []
    for stage in stages:
        local = stage_names(stage, full)
        opt = torch.optim.Adam([{"params": [named[n] for n in g]} for g in local], lr=0.5)
        opt.load_state_dict(optimizer_state_to_torch(by_name, local))
        opts.append(opt)
    return opts


def test_layout_records_tied_names_and_order() -> None:
    model = Tied()
    layout = ModelLayout.from_module(model)
    assert layout.keys == tuple(model.state_dict().keys())
    assert layout.aliases == (("emb.weight", "head.weight"),)
    assert layout.names_of("head.weight") == ("head.weight", "emb.weight")
    assert ModelLayout.from_json(layout.to_json()) == layout


def test_partial_model_dicts_merge_to_plain_state_dict() -> None:
    model, _, _ = plain_setup()
    layout = ModelLayout.from_module(model)
    sd = model.state_dict()
    buffers = {"body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"}
    parts = []
    for stage in STAGES_2:
        local = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())
                 if n in stage or (n in buffers and "body.1.weight" in stage)}
        part = local_model_state_dict(local, layout)
        assert is_partial(part)
        parts.append(part)
    assert "head.weight" in parts[1] and "head.weight" in parts[0]  # every tied name saved
    merged = merge_model_state_dicts(parts, layout)
    assert_same(dict(merged), dict(sd))
    fresh = Tied()
    fresh.load_state_dict(merged, strict=True)
    assert check_model_keys(merged, layout) == ([], [])


def test_merge_without_layout_and_select_into_stage() -> None:
    model = Tied()
    layout = ModelLayout.from_module(model)
    full = model.state_dict()
    chosen, missing = select_model_state(full, ["head.weight", "body.2.bias", "nope"], layout)
    assert missing == ["nope"]
    assert chosen["head.weight"] is full["head.weight"]
    a = {"x": torch.ones(2), PARTIAL_KEY: True}
    b = {"y": torch.zeros(1), "x": torch.ones(2), PARTIAL_KEY: True}
    assert list(merge_model_state_dicts([a, b])) == ["y", "x"]  # b says y comes first


def test_merge_orders_recovers_plain_order_from_stage_orders() -> None:
    plain = ["emb", "b0.w", "b0.b", "b1.w", "b2.w", "b2.b", "head"]
    stage0 = ["emb", "b0.w", "b0.b", "b1.w", "head"]  # tied head saved by both stages
    stage1 = ["emb", "b2.w", "b2.b", "head"]
    assert merge_orders([stage0, stage1]) == plain
    assert merge_orders([["a", "b"], ["b", "a"]]) == ["a", "b"]  # contradiction: first seen


def test_merge_rejects_divergent_replicas_and_missing_keys() -> None:
    layout = ModelLayout.from_module(nn.Linear(2, 2))
    a = {"weight": torch.ones(2, 2), PARTIAL_KEY: True}
    with pytest.raises(SMPCheckpointError, match="missing keys"):
        merge_model_state_dicts([a], layout)
    b = {"weight": torch.zeros(2, 2), "bias": torch.ones(2), PARTIAL_KEY: True}
    with pytest.raises(SMPCheckpointError, match="must be equal"):
        merge_model_state_dicts([a, b], layout)
    missing, unexpected = check_model_keys({"weight": 1, "extra": 2}, layout)
    assert missing == ["bias"] and unexpected == ["extra"]


@pytest.mark.parametrize("stages", [STAGES_2, STAGES_3], ids=["pp2", "pp3"])
def test_optimizer_round_trip_through_stages_equals_plain(stages: list[set[str]]) -> None:
    model, opt, full = plain_setup()
    plain_sd = opt.state_dict()
    opts = make_stage_optimizers(model, full, stages, plain_sd)
    parts = [opt_s.state_dict() for opt_s in opts]
    partials = [local_optimizer_state_dict(sd, stage_names(st, full), full)
                for sd, st in zip(parts, stages)]
    for p in partials:
        assert p[PARTIAL_KEY] is True and p[GROUP_PARAMS_KEY] == full
        assert all(isinstance(k, str) for k in p["state"])
    merged = merge_optimizer_state_dicts(partials)
    assert_same(merged, plain_sd)


def test_repartition_partials_from_pp2_into_pp3() -> None:
    """Partials saved at 2 stages, merged by name, loaded into 3 stages, merged again."""
    model, opt, full = plain_setup()
    plain_sd = opt.state_dict()
    opts2 = make_stage_optimizers(model, full, STAGES_2, plain_sd)
    parts2 = [local_optimizer_state_dict(o.state_dict(), stage_names(s, full), full)
              for o, s in zip(opts2, STAGES_2)]
    union = merge_partial_optimizer_states(parts2)
    named = dict(model.named_parameters())
    parts3 = []
    for stage in STAGES_3:
        local = stage_names(stage, full)
        o = torch.optim.Adam([{"params": [named[n] for n in g]} for g in local], lr=3.0)
        o.load_state_dict(optimizer_state_to_torch(union, local))
        parts3.append(local_optimizer_state_dict(o.state_dict(), local, full))
    assert_same(merge_optimizer_state_dicts(parts3), plain_sd)


def test_optimizer_merge_errors() -> None:
    model, opt, full = plain_setup()
    plain_sd = opt.state_dict()
    opts = make_stage_optimizers(model, full, STAGES_2, plain_sd)
    parts = [local_optimizer_state_dict(o.state_dict(), stage_names(s, full), full)
             for o, s in zip(opts, STAGES_2)]
    with pytest.raises(SMPCheckpointError, match="does not cover"):
        merge_optimizer_state_dicts(parts[:1])
    bad = dict(parts[1], param_groups=[dict(g, lr=9.0) for g in parts[1]["param_groups"]])
    with pytest.raises(SMPCheckpointError, match="hyperparameters differ"):
        merge_optimizer_state_dicts([parts[0], bad])
    diverged = dict(parts[1], state=dict(parts[1]["state"]))
    diverged["state"]["emb.weight"] = {**diverged["state"]["emb.weight"],
                                       "exp_avg": torch.zeros(7, 4)}
    with pytest.raises(SMPCheckpointError, match="differs between partial"):
        merge_optimizer_state_dicts([parts[0], diverged])
    swapped = [full[1], full[0]]
    with pytest.raises(SMPCheckpointError, match="different param group"):
        optimizer_state_to_torch(optimizer_state_by_name(plain_sd, full), swapped)
    with pytest.raises(SMPCheckpointError, match="number of param groups"):
        optimizer_state_by_name(plain_sd, full[:1])


def test_stage_with_an_empty_param_group_round_trips() -> None:
    model, opt, full = plain_setup()
    plain_sd = opt.state_dict()
    stages = [set(full[0]), set(full[1])]  # each stage holds exactly one group
    opts = make_stage_optimizers(model, full, stages, plain_sd)
    assert [len(g["params"]) for g in opts[0].param_groups] == [3, 0]
    parts = [local_optimizer_state_dict(o.state_dict(), stage_names(s, full), full)
             for o, s in zip(opts, stages)]
    assert_same(merge_optimizer_state_dicts(parts), plain_sd)
