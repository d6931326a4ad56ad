"""One export per host across real gloo ranks: the lowest rank holding a model exports it
and sends it to the others holding the same model; a rank alone with its model, and every
rank after a failed export, exports for itself and says why. Every multi-process test of a
Hugging Face model trains through it (the grid's numerics against one process)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import smp_fx as smp
from examples.models import hf_zoo
from passes import trace_share
from passes.meta import MODULE_PATH
from passes.trace import trace
from smp_fx.runtime.planning import shared_export
from smp_fx.world import state
from tests.helpers.dist import run_ranks

pytestmark = pytest.mark.skipif(trace_share.available() is not None,
                                reason=str(trace_share.available()))

ARCH_OF_RANK = ("llama", "llama", "gpt2", "llama")


def _body() -> dict[str, Any]:
    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    arch = ARCH_OF_RANK[smp.rank()]
    model = hf_zoo.build(arch, seed=smp.rank())
    x = hf_zoo.inputs(arch)
    share = shared_export.host_share(state.get())
    assert share is not None
    before = (shared_export.STATS.sent, shared_export.STATS.received)
    gm = trace(model, x, share=share)
    own = trace(model, x, frontend="export")
    with torch.no_grad():
        exact = bool(torch.equal(gm(*x), model(*x)))
    return {"sent": shared_export.STATS.sent - before[0],
            "received": shared_export.STATS.received - before[1],
            "own": dict(shared_export.STATS.own), "exact": exact,
            "mine": all(gm.get_parameter(n) is p for n, p in model.named_parameters()),
            "same_graph": [MODULE_PATH.get(n) for n in gm.graph.nodes]
            == [MODULE_PATH.get(n) for n in own.graph.nodes]}


@pytest.mark.multiproc
def test_the_lowest_rank_holding_a_model_exports_it_for_the_others() -> None:
    results = run_ranks(_body, 4, timeout=300)
    assert [r["sent"] for r in results] == [1, 0, 0, 0], results
    assert [r["received"] for r in results] == [0, 1, 0, 1], results
    assert all(r["exact"] and r["mine"] and r["same_graph"] for r in results), results
    assert "no other rank on this host holds the same model" in results[2]["own"]


def _failing_body() -> dict[str, Any]:
    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    model = hf_zoo.build("llama")
    x = hf_zoo.inputs("llama")
    share = shared_export.host_share(state.get())
    assert share is not None
    out: dict[str, Any] = {}

    def failing_on_rank_0() -> torch.fx.GraphModule:
        if smp.rank() == 0:
            raise RuntimeError("this export fails")
        return trace(model, x, frontend="export")

    try:
        share.run(model, x, {}, failing_on_rank_0)
    except RuntimeError as exc:
        out["raised"] = str(exc)

    def unreadable(data: bytes, model: Any) -> Any:
        raise ValueError("these bytes do not load")

    if smp.rank() == 1:  # the next graph rank 0 sends does not load here
        shared_export.from_bytes = unreadable  # type: ignore[assignment]
    gm = share.run(model, x, {}, lambda: trace(model, x, frontend="export"))
    out["exact"] = bool(torch.equal(gm(*x), model(*x)))
    out["own"] = dict(shared_export.STATS.own)
    return out


@pytest.mark.multiproc
def test_after_a_failed_export_or_load_a_rank_exports_for_itself() -> None:
    first, second = run_ranks(_failing_body, 2, timeout=300)
    assert first["raised"] == "this export fails" and "raised" not in second
    assert first["exact"] and second["exact"]
    assert second["own"] == {"rank 0's export failed or could not be handed on": 1,
                             "rank 0's graph did not load here (ValueError: these bytes do "
                             "not load)": 1}, second


def test_one_process_and_the_switch_share_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    smp.init({"pipeline_parallel_degree": 1})
    assert shared_export.host_share(state.get()) is None  # one process
    monkeypatch.setenv("SMP_FX_TRACE_SHARE", "0")
    assert shared_export.host_share(SimpleNamespace(in_process=False, world_size=2)) is None
