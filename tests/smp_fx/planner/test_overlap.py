"""Megatron-Core's overlaps (smp_fx.planner.overlap) and the step priced under them."""

from __future__ import annotations

from cost_model.memory import MemoryPerGPU
from cost_model.schedule_cost import RankTimes
from smp_fx.planner.overlap import (
    hide_tp,
    megatron_bucket_elems,
    megatron_memory,
    megatron_precision,
    overlapped,
)


def test_tp_communication_hides_behind_compute_up_to_its_length() -> None:
    times = (RankTimes(1.0, 2.0, 0.5), RankTimes(1.0, 1.0), RankTimes(1.0, 1.0))
    hidden = hide_tp(times, (0.6, 1.5, 0.0))
    assert abs(hidden[0].total_s - 2.4) < 1e-12  # 3.0 - 0.6: compute is longer
    assert abs(hidden[0].wgrad_s / hidden[0].bwd_s - 0.25) < 1e-12  # shares kept
    assert abs(hidden[1].total_s - 1.5) < 1e-12  # communication is longer: it is the time
    assert hidden[2] == times[2]


def test_a_bucketed_collective_leaves_at_least_its_last_bucket() -> None:
    assert overlapped(1.0, 0.3, 0.1) == 0.7
    assert overlapped(1.0, 5.0, 0.1) == 0.1
    assert overlapped(1.0, 5.0, 3.0) == 1.0
    assert megatron_bucket_elems(8) == 40_000_000
    assert megatron_bucket_elems(64) == 64_000_000


def test_megatron_memory_keeps_fp32_main_grads_and_no_bucket_copy() -> None:
    assert megatron_precision("bf16") == "megatron_bf16"
    assert megatron_precision("fp16") == "fp16"
    mem = MemoryPerGPU(2, 4, 12, 0, 0, buffers=4 * 10 + 7, outputs=0)
    assert megatron_memory(8, "zero1", 10, "bf16", mem).buffers == 7
    assert megatron_memory(1, "none", 10, "bf16", mem) == mem
    assert megatron_memory(8, "fsdp", 10, "bf16", mem) == mem


def test_megatron_distributed_optimizer_shards_over_dp_and_cp() -> None:
    mem = MemoryPerGPU(2, 4, 13, 0, 0, buffers=0, outputs=0)
    assert megatron_memory(4, "zero1", 10, "bf16", mem, cp=2).optimizer == 7
    assert megatron_memory(4, "zero1", 10, "bf16", mem, cp=1).optimizer == 13
    assert megatron_memory(4, "none", 10, "bf16", mem, cp=2).optimizer == 13
    assert megatron_memory(4, "fsdp", 10, "bf16", mem, cp=2) == mem
