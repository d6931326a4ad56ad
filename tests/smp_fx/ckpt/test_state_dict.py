"""Tests for smp_fx.ckpt.state_dict: pure merging/splitting by FQN against the plain model.

The "stages" here are simulated in-process: each holds a subset of the plain model's
parameters and its own torch optimizer over them, as a pipeline rank does.
"""

from __future__ import annotations

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
from tests.helpers.ckpt import (
    STAGES_2,
    STAGES_3,
    Tied,
    assert_same,
    make_stage_optimizers,
    plain_setup,
    stage_names,
)


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
