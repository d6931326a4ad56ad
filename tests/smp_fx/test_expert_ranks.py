"""Expert parallelism's rank layout and the configurations ``smp.init`` refuses for it."""

from __future__ import annotations

import pytest

from smp_fx import SMPConfigError
from smp_fx.config import combination_refusal, validate
from smp_fx.expert_ranks import (
    check_experts_divide,
    edp_groups,
    ep_groups,
    ep_rank,
    expert_slice,
    table,
)


def test_ep_groups_are_consecutive_rdp_ranks_and_edp_their_columns() -> None:
    rdp = [1, 3, 5, 7, 9, 11]  # an rdp group of 6 (pp 2: every other global rank)
    assert ep_groups(rdp, 2) == [[1, 3], [5, 7], [9, 11]]
    assert edp_groups(rdp, 2) == [[1, 5, 9], [3, 7, 11]]
    assert [ep_rank(i, 3) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert list(expert_slice(8, 4, 3)) == [6, 7]
    assert table([0, 1, 2, 3], 2).splitlines()[1:] == ["0    0       0", "1    1       0",
                                                       "2    0       1", "3    1       1"]


def test_ep_not_dividing_the_rdp_ranks_is_refused_at_init() -> None:
    cfg = {"pipeline_parallel_degree": 2, "ddp": True, "expert_parallel_degree": 3}
    with pytest.raises(SMPConfigError, match="expert_parallel_degree.*divide.*= 4.*got 3"):
        validate(cfg, 8)
    assert validate({**cfg, "expert_parallel_degree": 4}, 8)[1].rdp_size == 4


def test_ep_without_ddp_is_refused_naming_the_fix() -> None:
    why = combination_refusal({"ddp": False, "expert_parallel_degree": 2})
    assert isinstance(why, SMPConfigError) and "expert_parallel_degree" in str(why)
    assert "Fix: " in str(why) and "\n" not in str(why)


def test_ep_not_dividing_a_blocks_experts_is_refused_with_its_name() -> None:
    with pytest.raises(SMPConfigError, match=r"got 4\) at layers\.0\.mlp\.experts \(6 experts\)"):
        check_experts_divide(4, 6, "layers.0.mlp.experts")
