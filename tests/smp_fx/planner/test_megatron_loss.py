"""Megatron-Core's fp32 cross entropy (smp_fx.planner.megatron_loss) and where the step
prices it: on the rank holding the last chunk, for Megatron-Core's runtime only."""

from __future__ import annotations

import dataclasses

import pytest

from cost_model.cluster import get_cluster
from cost_model.schedule_cost import RankTimes
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.megatron_loss import loss_bytes, loss_times
from smp_fx.planner.stages import Ranks
from smp_fx.planner.step import Setting, links


def test_bytes_per_logit_follow_megatrons_kernels() -> None:
    # bf16 logits: cast 2 + 4, max 4, subtract 8, exp 8, sum 4, divide 8; backward:
    # the in-place scale 8 and the cast back 4 + 2
    assert loss_bytes(1, 2) == (38, 14)
    assert loss_bytes(10, 2) == (380, 140)
    assert loss_bytes(1, 4) == (32, 8)  # fp32 logits: .float() copies nothing


def test_time_is_the_slice_of_the_vocabulary_at_the_gpus_bandwidth() -> None:
    spec = get_cluster("dgx-h100").device
    logits = 4096 * 131072 * 2  # one bf16 sample of a 131072-token vocabulary
    fwd, bwd = loss_times(logits, 2, 1, spec)
    rate = spec.bandwidth(4096 * 131072 * 4.0)
    assert fwd == pytest.approx(4096 * 131072 * 38 / rate)
    assert bwd == pytest.approx(4096 * 131072 * 14 / rate)
    assert 6e-3 < fwd + bwd < 12e-3  # about 9 ms on an H100 (2.85 TB/s)
    assert loss_times(logits, 2, 8, spec)[0] == pytest.approx(fwd / 8)
    assert loss_times(0, 2, 1, spec) == (0.0, 0.0)


def _ranks(p: int, output_bytes: int) -> Ranks:
    one = (RankTimes(1.0, 2.0, 0.5),) * p
    zeros = (0,) * p
    return Ranks(one, (0.0,) * p, (10,) * p, (1,) * p, ((),) * p, zeros, zeros, zeros,
                 (0.0,) * p, (1,) * p, ((64, 64),) * (p - 1), 10, output_bytes=output_bytes)


@pytest.mark.parametrize("schedule,vp,last", [("interleaved", 1, 2), ("zbv", 2, 0)])
def test_the_loss_lands_on_the_rank_of_the_last_chunk(schedule: str, vp: int,
                                                     last: int) -> None:
    cluster = get_cluster("dgx-h100")
    c = Candidate(tp=2, pp=3, dp=1, mbs=1, vp=vp, schedule=schedule, recompute="none",
                  sp=False, zero="none")
    logits = 1 << 30
    core = Setting(cluster, 6, 6, runtime="megatron-core")
    fwd, bwd = loss_times(logits, 2, 2, cluster.device)
    with_loss = links(c, _ranks(3, logits), core).times
    without = links(c, _ranks(3, 0), core).times
    for r in range(3):
        extra = (fwd, bwd) if r == last else (0.0, 0.0)
        assert with_loss[r].fwd_s - without[r].fwd_s == pytest.approx(extra[0])
        assert with_loss[r].bwd_s - without[r].bwd_s == pytest.approx(extra[1])
        assert with_loss[r].wgrad_s == without[r].wgrad_s
    smp = dataclasses.replace(core, runtime="smp-fx")  # its loss is the script's: unpriced
    assert links(c, _ranks(3, logits), smp).times == links(c, _ranks(3, 0), smp).times
