"""What Megatron-Core keeps, as the planner prices runs made with it: its distributed
optimizer sharded over dp x cp (smp-fx's ZeRO-1 over dp only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cost_model.cluster import get_cluster
from smp_fx.planner.candidate import Candidate
from smp_fx.planner.model import Profiler
from smp_fx.planner.stages import rank_loads
from smp_fx.planner.step import Setting, memory_by_rank

ROOT = Path(__file__).resolve().parents[3]
LLAMA = ROOT / "tests" / "data" / "hf_tiny_llama"
SEQ, MBS = 32, 1
CLUSTER = get_cluster("dgx-h100")


@pytest.fixture(scope="module")
def llama() -> Profiler:
    pytest.importorskip("transformers")
    from smp_fx.planner.hf_config import prepare_config

    return Profiler(prepare_config(LLAMA, SEQ), CLUSTER)


@pytest.mark.parametrize("runtime, divided", [("megatron-core", 2), ("smp-fx", 1)])
def test_distributed_optimizer_shards_over_cp_under_megatron_only(
        llama: Profiler, runtime: str, divided: int) -> None:
    prof = llama(MBS, 1, False)
    ranks = rank_loads(prof, "none", 1, 1, "interleaved", CLUSTER.device)
    assert ranks is not None
    opt = {}
    for cp in (1, 2):
        c = Candidate(1, 1, 2, MBS, 1, "interleaved", "none", False, "zero1", cp=cp)
        setting = Setting(CLUSTER, 2 * cp, 2 * MBS, runtime=runtime)
        opt[cp] = memory_by_rank(c, ranks, prof, setting)[0].optimizer
    assert opt[2] == -(-opt[1] // divided)
