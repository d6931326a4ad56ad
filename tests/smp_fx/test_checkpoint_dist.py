"""Multi-process checkpoint tests (gloo, real ranks via tests/helpers/dist.py).

File-level: smp.save / smp.load over real model-parallel groups, called by dp_rank 0 only
(the seed's pattern), and loaded at another pipeline degree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.multiproc


def _stage_state(pp_rank: int) -> dict[str, Any]:
    return {f"stage{pp_rank}.weight": torch.full((3,), float(pp_rank + 1)),
            "_smp_is_partial": True}


def _save_then_load(prefix: str) -> dict[str, Any]:
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": 2, "ddp": True})
    if smp.dp_rank() == 0:  # only one model replica saves: a collective of its mp group
        smp.save({"model_state_dict": _stage_state(smp.pp_rank()), "step": 3}, prefix)
        smp.save({"full": True, "pp": smp.pp_rank()}, prefix + ".full", partial=False)
    smp.barrier()
    loaded = smp.load(prefix)  # every rank loads its mp rank's file
    full = smp.load(prefix + ".full", partial=False)
    return {"pp": smp.pp_rank(), "keys": sorted(loaded["model_state_dict"]),
            "step": loaded["step"], "full_from": full["pp"]}


def _load_at_pp1(prefix: str) -> list[str]:
    import smp_fx as smp

    smp.init({"pipeline_parallel_degree": 1})
    loaded = smp.load(prefix)
    return [k for k in loaded["model_state_dict"] if k != "_smp_is_partial"]


def test_dp0_saves_partial_every_rank_loads_then_pp1_merges(tmp_path: Path) -> None:
    prefix = str(tmp_path / "checkpoint.pt")
    out = run_ranks(_save_then_load, 4, prefix, timeout=90)
    for res in out:
        assert res["keys"] == ["_smp_is_partial", f"stage{res['pp']}.weight"]
        assert res["step"] == 3 and res["full_from"] == 0  # mp rank 0 wrote the full file
    assert {r["pp"] for r in out} == {0, 1}
    merged = run_ranks(_load_at_pp1, 1, prefix, timeout=60)[0]
    assert merged == ["stage0.weight", "stage1.weight"]
