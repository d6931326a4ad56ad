"""Compiled stages under sharded data parallelism (``compile`` with
``sharded_data_parallel_degree``) equal the plain model: each stage compiled whole as one
FSDP2 unit, its hooks (gather, free, reduce-scatter) on the stage module outside the graph.

On 4 gloo processes: the example GPT at pp 2 x sdp 2 under 1F1B and interleaved v = 2
(every stage compiled whole, sharded as one unit), with every block checkpointed, and under
ZB-V (the chunk whose inputs need no gradient compiled, those that receive gradients eager
with the reason told); the
MLP at pp 1 x sdp 2 with a unit per linear when eager (``sdp_reduce_bucket_size``),
compiled as one unit, with gradient clipping; and the same with ``sdp_max_live_parameters``
below the stage's parameters: eager, sharded in units, the reason told. Losses, gradients
and parameters after 3 Adam steps within 1e-5 of the plain model's. Hugging Face Llama from
its config at tp 2 x sdp 2: compiled (tensor parallelism's collectives inside the graph,
FSDP2's hooks outside) equals eager after 3 Adam steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from smp_fx.parallel.sdp import plan_units
from tests.helpers.compare import Checks, mismatched
from tests.helpers.dist import run_ranks
from tests.helpers.twin import Twin, init

SDP = {"sharded_data_parallel_degree": 2, "compile": "aot_eager"}
MLP = {"sdp_reduce_bucket_size": 300, "sdp_param_persistence_threshold": 40}


def _units(t: Twin) -> dict[int, int]:
    """Per local stage, its FSDP2 units besides the root."""
    return {s: len(p.units) for s, p in t.dm.parallelized.sharded.plans.items()}


def _pipelined(c: Checks) -> None:
    from tests.smp_fx.test_schedules_compose import _adam

    for pipe, v in (("interleaved", 1), ("interleaved", 2)):
        t = _adam(c, pipe, v, **SDP)
        stats = t.dm.parallelized.compiled
        c.expect(all(st.fallback is None and st.compiles == 1 for st in stats.values()),
                 f"{pipe} v={v}: every stage compiled once {stats}")
        c.expect(set(_units(t).values()) == {0}, f"{pipe} v={v}: one unit a stage")
    t = _adam(c, "zbv", 2, **SDP)
    for s, st in t.dm.parallelized.compiled.items():
        receives = bool(t.dm.parallelized.runners[s].stage.recvs)
        told = st.fallback is not None and "split backward" in st.fallback
        c.expect(told == receives and (receives or st.compiles == 1),
                 f"zbv: stage {s} {st.summary()}")


def _checkpointed(c: Checks) -> None:
    """The GPT at pp 2 x sdp 2, each block checkpointed (the recompute in the graph)."""
    from tests.smp_fx.test_schedules_compose import _adam

    t = _adam(c, "interleaved", 1, checkpointed=True, **SDP)
    stats = t.dm.parallelized.compiled.values()
    c.expect(all(st.fallback is None and st.compiles == 1 for st in stats),
             f"checkpointed: compiled {[st.summary() for st in stats]}")


def _mlp(c: Checks, **extra: Any) -> Twin:
    """The MLP at pp 1 x sdp 2, compiled, 3 Adam steps with clipping against the plain one."""
    import smp_fx as smp
    from tests.smp_fx.parallel.test_sharding_dist import ATOL, _adam, _train

    init(1, 2, **SDP, **MLP, **extra)
    t = Twin("mlp")
    opt = smp.DistributedOptimizer(_adam(t.dm.parameters()))
    _train(t, opt, _adam(t.ref.parameters()), 3, clip=1.0)
    c.expect(not mismatched(t.local(), t.reference(), atol=ATOL), f"mlp {extra}: parameters")
    c.expect(any(hasattr(p, "full_tensor") for p in t.dm.local_parameters()),
             f"mlp {extra}: parameters are sharded")
    return t


def _hf_tp(c: Checks) -> None:
    """Llama at tp 2 x sdp 2, compiled against eager: the state after 3 Adam steps."""
    from tests.helpers.zoo import DistributedRun, batches

    config = {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 2,
              "prescaled_batch": True, "sharded_data_parallel_degree": 2,
              "sdp_param_persistence_threshold": 64}

    def trained(compile: str) -> DistributedRun:
        run = DistributedRun("llama", {**config, "compile": compile}, _adam_hf)
        for batch in batches("llama", 4, 3):
            run.step(batch)
        return run

    want = trained("none").state()
    run = trained("aot_eager")
    (st,) = run.model.parallelized.compiled.values()
    c.expect(st.fallback is None and st.compiles == 1, f"llama tp 2 x sdp 2: {st.summary()}")
    bad = mismatched(run.state(), want, atol=1e-5, rtol=1e-4)
    c.expect(not bad, f"llama tp 2 x sdp 2: compiled against eager {bad[:3]}")


def _adam_hf(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def _body() -> tuple[int, list[str]]:
    from smp_fx.world import state

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    c = Checks()
    try:
        _pipelined(c)
        _checkpointed(c)
        t = _mlp(c)
        (st,) = t.dm.parallelized.compiled.values()
        gm = t.dm.parallelized.runners[0].stage.module
        eager_units = len(plan_units(gm, MLP["sdp_reduce_bucket_size"],
                                     MLP["sdp_param_persistence_threshold"]).units)
        c.expect(st.fallback is None and st.compiles == 1, f"mlp: compiled {st.summary()}")
        c.expect(_units(t) == {0: 0} and eager_units == 9, f"mlp: one unit, not {eager_units}")
        t = _mlp(c, sdp_max_live_parameters=10_000)  # 9 units of <= 4160 fit; 31,872 do not
        (st,) = t.dm.parallelized.compiled.values()
        c.expect(st.fallback is not None and "sdp_max_live_parameters" in st.fallback
                 and "31872" in st.fallback, f"mlp: over the live bound {st.summary()}")
        c.expect(_units(t) == {0: 9}, f"mlp: over the live bound, units {_units(t)}")
        _hf_tp(c)
    finally:
        state._reset()
    return c.report()


@pytest.mark.multiproc
def test_compiled_stages_under_sharded_data_parallelism_equal_the_plain_model() -> None:
    reports = run_ranks(_body, 4, timeout=600)
    assert [failed for _, failed in reports] == [[]] * 4
    assert all(count == reports[0][0] and count > 20 for count, _ in reports)
