"""Elastic restarts without processes: the degrees and microbatches a smaller world runs at,
the worlds refused, and what a launcher under a node range exports."""

from __future__ import annotations

import pytest

from cost_model.errors import SMPConfigError
from smp_fx.config import load_config
from smp_fx.world import elastic

PP2 = load_config({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True}, env={})
FULL4 = {elastic.FULL_WORLD_ENV: "4", "TORCHELASTIC_RESTART_COUNT": "1"}


def test_a_halved_world_doubles_the_microbatches_and_says_so() -> None:
    cfg, note = elastic.adjust(PP2, 2, FULL4)
    assert cfg.microbatches == 4 and cfg.pipeline_parallel_degree == 2
    assert note is not None and note.startswith(
        "smp-fx elastic: 2 of 4 processes: pp 2 x tp 1 kept, dp 1 (full 2); microbatches 2 -> 4")


def test_the_full_world_or_no_range_changes_nothing() -> None:
    assert elastic.adjust(PP2, 4, FULL4) == (PP2, None)
    assert elastic.adjust(PP2, 2, {}) == (PP2, None)


def test_a_dp_that_does_not_divide_the_full_one_keeps_the_microbatches() -> None:
    cfg, note = elastic.adjust(PP2, 4, {elastic.FULL_WORLD_ENV: "6"})
    assert cfg is PP2 and note is not None
    assert "dp 2 (full 3); microbatches stay 2, so each is 1.5x larger" in note


@pytest.mark.parametrize("world", [1, 3])
def test_survivors_that_cannot_hold_pp_x_tp_are_refused(world: int) -> None:
    with pytest.raises(SMPConfigError, match=f"{world} processes cannot hold pipeline x tensor"
                       " x context parallel degrees = 2 .*attempt 1, full world 4"):
        elastic.adjust(PP2, world, FULL4)
    with pytest.raises(SMPConfigError, match="must be a whole number"):
        elastic.adjust(PP2, 2, {elastic.FULL_WORLD_ENV: "four"})


def test_launch_env_and_node_ranges() -> None:
    assert elastic.launch_env("1:2", 2, False) == {elastic.FULL_WORLD_ENV: "4",
                                                   elastic.NO_SHARED_STORE_ENV: "1"}
    assert elastic.launch_env("2", 2, True) == {elastic.NO_SHARED_STORE_ENV: "1"}
    assert elastic.launch_env("2", 2, False) == {}
    assert elastic.node_range(None) is None and elastic.node_range("3") is None
    for bad in ("2:1", "0:2", "a:2"):
        with pytest.raises(SMPConfigError, match="MIN:MAX"):
            elastic.node_range(bad)


def test_a_node_range_whose_sizes_cannot_all_hold_pp_is_refused() -> None:
    pp4 = load_config({"pipeline_parallel_degree": 4}, env={})
    elastic.check_range(pp4, "2:4", 4)
    with pytest.raises(SMPConfigError, match=r"got '3 nodes x 2 = 6'.*without \[3\]"):
        elastic.check_range(pp4, "2:4", 2)


def test_advice_for_restarts_across_nodes_on_a_shared_store() -> None:
    torchrun = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3",
                "GROUP_WORLD_SIZE": "2"}
    advice = elastic.shared_store_advice(torchrun)
    assert advice is not None and f"export {elastic.NO_SHARED_STORE_ENV}=1" in advice
    assert elastic.shared_store_advice({**torchrun, "GROUP_WORLD_SIZE": "1"}) is None
    assert elastic.shared_store_advice({**torchrun, "TORCHELASTIC_USE_AGENT_STORE": "False"}
                                       ) is None
