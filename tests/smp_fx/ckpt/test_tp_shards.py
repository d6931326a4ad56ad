"""``smp_fx.ckpt.tp_shards``: shard descriptions joined back and re-cut, plain and strided
(a fused q/k/v projection: ``stride`` blocks, each split over the ranks)."""

from __future__ import annotations

import pytest
import torch

from passes.tensor_parallel import ShardSpec
from passes.tensor_parallel import graph as tp_graph
from smp_fx import SMPError
from smp_fx.ckpt import tp_shards


@pytest.mark.parametrize("stride", [1, 3])
def test_join_then_cut_gives_every_ranks_shard_back(stride: int) -> None:
    full = torch.arange(12 * 2, dtype=torch.float32).reshape(12, 2)
    spec = ShardSpec("w", 0, 2, (12, 2), stride)
    shards = [tp_graph.shard(full, 0, 2, r, stride) for r in range(2)]
    parts = [{"w": s, "b": torch.ones(2), tp_shards.TP_SHARDS_KEY:
              tp_shards.describe([spec], r, ["w", "b"])} for r, s in enumerate(shards)]
    joined = tp_shards.join(parts)
    for part in joined:
        torch.testing.assert_close(part["w"], full)
        assert tp_shards.TP_SHARDS_KEY not in part
    for r in range(2):
        torch.testing.assert_close(tp_shards.cut(full, spec, r, (6, 2)), shards[r])
    if stride == 3:  # rank 0 holds the first half of each of the three blocks
        assert shards[0][0:2, 0].tolist() == [0.0, 2.0]
        assert shards[0][2:4, 0].tolist() == [8.0, 10.0]


def test_an_optimizer_state_is_joined_per_field_and_a_missing_shard_is_an_error() -> None:
    spec = ShardSpec("w", 1, 2, (2, 4))
    parts = [{"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 2), r)}},
              "param_groups": [], tp_shards.TP_SHARDS_KEY: tp_shards.describe([spec], r, ["w"])}
             for r in range(2)]
    joined = tp_shards.join(parts)[0]["state"]["w"]
    assert joined["step"].item() == 3.0
    assert joined["exp_avg"].tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    with pytest.raises(SMPError, match="shards are not all in the checkpoint"):
        tp_shards.join(parts[:1])


def test_a_padded_vocabulary_is_joined_unpadded_and_cut_padded() -> None:
    """5 rows over 2 ranks: 3 rows each, the last one zero padding; files hold the padded
    shards, ``join`` gives the 5 rows (model and optimizer fields), ``cut`` re-pads."""
    full = torch.arange(5 * 2, dtype=torch.float32).reshape(5, 2)
    spec = ShardSpec("wte", 0, 2, (5, 2), pad=1)
    shards = [tp_graph.shard(tp_graph.pad(full, 0, 1), 0, 2, r) for r in range(2)]
    assert shards[1][-1].tolist() == [0.0, 0.0]
    table = [tp_shards.describe([spec], r, ["wte"]) for r in range(2)]
    assert table[0] == {"wte": [0, 2, 0, 1, 1]}
    model = tp_shards.join([{"wte": s, tp_shards.TP_SHARDS_KEY: t}
                            for s, t in zip(shards, table)])
    torch.testing.assert_close(model[1]["wte"], full, atol=0, rtol=0)
    opt = tp_shards.join([{"state": {"wte": {"exp_avg": s * 2, "step": torch.tensor(1.0)}},
                           "param_groups": [], tp_shards.TP_SHARDS_KEY: t}
                          for s, t in zip(shards, table)])
    torch.testing.assert_close(opt[0]["state"]["wte"]["exp_avg"], full * 2, atol=0, rtol=0)
    for r in range(2):
        torch.testing.assert_close(tp_shards.cut(full, spec, r, (3, 2)), shards[r])
        got = tp_shards.cut({"exp_avg": full, "step": torch.tensor(1.0)}, spec, r, (3, 2))
        torch.testing.assert_close(got["exp_avg"], shards[r])
    # the same shard without the padding field is another layout
    assert tp_shards.foreign({tp_shards.TP_SHARDS_KEY: {"wte": [0, 2, 0, 1]}}, type(
        "Plan", (), {"sharded": (spec,)})(), 0) == ["wte"]
    assert tp_shards.foreign({tp_shards.TP_SHARDS_KEY: table[0]}, type(
        "Plan", (), {"sharded": (spec,)})(), 0) == []
