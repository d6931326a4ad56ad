"""Real gloo processes: the seed's placements produce exactly these groups, collectives over
every group work, and SMP's object communication (send/recv_from/broadcast/allgather)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import smp_fx as smp
from cost_model.errors import SMPRuntimeError
from smp_fx.world import state
from tests.helpers.dist import RankFailed, run_ranks

pytestmark = pytest.mark.multiproc

# Seed table for "PTD" with tp = pp = rdp = 2: rank -> (rdp_rank, pp_rank, tp_rank).
PTD = {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 0, 1), 3: (1, 0, 1),
       4: (0, 1, 0), 5: (1, 1, 0), 6: (0, 1, 1), 7: (1, 1, 1)}


def _groups_by_hand(me: int, table: dict[int, tuple[int, int, int]]) -> dict[str, list[int]]:
    """Groups from the table alone (independent of smp_fx.topology)."""
    rdp, pp, tp = table[me]
    same = {"pp": lambda c: c[0] == rdp and c[2] == tp, "tp": lambda c: c[0] == rdp and c[1] == pp,
            "rdp": lambda c: c[1] == pp and c[2] == tp, "dp": lambda c: c[1] == pp,
            "mp": lambda c: c[0] == rdp, "world": lambda c: True}
    return {axis: sorted(r for r, c in table.items() if f(c)) for axis, f in same.items()}


def _check_rank(config: dict[str, Any], table: dict[int, tuple[int, int, int]]) -> dict[str, Any]:
    smp.init(config)
    me = smp.rank()
    rdp, pp, tp = table[me]
    assert (smp.rdp_rank(), smp.pp_rank(), smp.tp_rank()) == (rdp, pp, tp)
    expected = _groups_by_hand(me, table)
    getters = {"mp": smp.get_mp_group, "dp": smp.get_dp_group, "pp": smp.get_pp_group,
               "tp": smp.get_tp_group, "rdp": smp.get_rdp_group}
    pgs = {"world": smp.get_world_process_group, "mp": smp.get_mp_process_group,
           "dp": smp.get_dp_process_group, "pp": smp.get_pp_process_group,
           "tp": smp.get_tp_process_group, "rdp": smp.get_rdp_process_group}
    sizes = {"mp": smp.mp_size, "dp": smp.dp_size, "pp": smp.pp_size, "tp": smp.tp_size,
             "rdp": smp.rdp_size, "world": smp.size}
    for axis, ranks in expected.items():
        if axis in getters:
            assert getters[axis]() == ranks, axis
        assert sizes[axis]() == len(ranks), axis
        pg = pgs[axis]()
        assert dist.get_process_group_ranks(pg) == ranks, axis
        t = torch.tensor([float(me)])
        dist.all_reduce(t, group=pg)
        assert t.item() == sum(ranks), axis
    assert smp.dp_rank() == expected["dp"].index(me)
    assert smp.mp_rank() == expected["mp"].index(me)
    # object communication
    gathered = smp.allgather({"rank": me}, smp.MP_GROUP)
    assert gathered == [{"rank": r} for r in expected["mp"]]
    if smp.dp_rank() == 0:
        smp.broadcast(("from", me), smp.DP_GROUP)
        got = None
    else:
        got = smp.recv_from(0, smp.RankType.DP_RANK)
        assert got == ("from", expected["dp"][0])
    peer = 1 - smp.pp_rank()  # pipeline neighbours exchange through PP_RANK addressing
    if smp.pp_rank() == 0:
        smp.send({"x": me}, peer, smp.PP_RANK)
        back = smp.recv_from(peer, smp.PP_RANK)
    else:
        back = smp.recv_from(peer, smp.PP_RANK)
        smp.send({"x": me}, peer, smp.PP_RANK)
    assert back == {"x": expected["pp"][peer]}
    smp.barrier()
    smp.dp_barrier()
    smp.mp_barrier()
    smp.barrier(smp.TP_GROUP)
    return {"rank": me, "got": got, "local": (smp.local_rank(), smp.local_size())}


def test_eight_ranks_ptd_seed_table() -> None:
    cfg = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
           "placement_strategy": "PTD"}
    out = run_ranks(_check_rank, 8, cfg, PTD, timeout=120)
    assert [o["rank"] for o in out] == list(range(8))
    assert out[3]["local"] == (3, 8)


def _as_mpirun(config: dict[str, Any], table: dict[int, tuple[int, int, int]]
               ) -> dict[str, Any]:
    """Rewrite the torchrun environment into Open MPI's, without MASTER_ADDR (so smp.init
    takes the mpirun path and joins through tcp://127.0.0.1:MASTER_PORT)."""
    import os

    for ours, ompi in (("RANK", "RANK"), ("WORLD_SIZE", "SIZE"), ("LOCAL_RANK", "LOCAL_RANK"),
                       ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")):
        os.environ[f"OMPI_COMM_WORLD_{ompi}"] = os.environ.pop(ours)
    del os.environ["MASTER_ADDR"]
    out = _check_rank(config, table)
    assert state.get().launch.launcher == "mpirun"
    return out


def test_four_ranks_spread_under_mpirun_env() -> None:
    # spread (TPD) with pp = 2, rdp = 2: ranks 0,1 are stage 0, ranks 2,3 stage 1.
    table = {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 1, 0), 3: (1, 1, 0)}
    cfg = {"partitions": 2, "ddp": True, "placement_strategy": "spread"}
    out = run_ranks(_as_mpirun, 4, cfg, table, timeout=90)
    assert [o["got"] for o in out] == [None, ("from", 0), None, ("from", 2)]


def _as_srun(config: dict[str, Any], table: dict[int, tuple[int, int, int]]
             ) -> dict[str, Any]:
    """Rewrite the torchrun environment into what srun sets for a one-node step (no
    MASTER_ADDR: the node list names the rendezvous host)."""
    import os

    world = os.environ.pop("WORLD_SIZE")
    os.environ.update(SLURM_PROCID=os.environ.pop("RANK"), SLURM_NTASKS=world,
                      SLURM_LOCALID=os.environ.pop("LOCAL_RANK"), SLURM_NODEID="0",
                      SLURM_TASKS_PER_NODE=os.environ.pop("LOCAL_WORLD_SIZE"),
                      SLURM_JOB_NODELIST="localhost")
    del os.environ["MASTER_ADDR"]
    out = _check_rank(config, table)
    info = state.get().launch
    assert (info.launcher, info.master_addr) == ("slurm", "localhost")
    return out


def test_four_ranks_spread_under_srun_env() -> None:
    table = {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 1, 0), 3: (1, 1, 0)}
    cfg = {"partitions": 2, "ddp": True, "placement_strategy": "spread"}
    out = run_ranks(_as_srun, 4, cfg, table, timeout=90)
    assert [o["got"] for o in out] == [None, ("from", 0), None, ("from", 2)]


def _bad_world() -> None:
    smp.init({"pipeline_parallel_degree": 4})


def test_bad_world_fails_on_every_rank_before_any_collective() -> None:
    with pytest.raises(RankFailed, match="divisible"):
        run_ranks(_bad_world, 2, timeout=60)


def test_single_process_in_process_pipeline() -> None:
    state._reset()
    try:
        smp.init({"pipeline_parallel_degree": 3})
        st = state.get()
        assert st.in_process and st.world_size == 1
        assert (smp.pp_size(), smp.pp_rank(), smp.mp_size(), smp.dp_size()) == (3, 0, 3, 1)
        assert smp.get_pp_group() == [0] and smp.get_dp_group() == [0]
        assert dist.get_world_size(smp.get_pp_process_group()) == 1
        assert smp.allgather(5, smp.WORLD) == [5]
        smp.barrier(smp.PP_GROUP)
        with pytest.raises(SMPRuntimeError, match="itself"):
            smp.send(1, 0, smp.WORLD_RANK)
        smp.init({"pipeline_parallel_degree": 3})  # same config again: no-op
        with pytest.raises(SMPRuntimeError, match="different configuration"):
            smp.init({"pipeline_parallel_degree": 2})
    finally:
        state._reset()
    assert not smp.is_initialized()
    with pytest.raises(SMPRuntimeError, match="smp.init"):
        state.get()


def _one_rank_skips_barrier(meeting: str) -> str:
    import os
    import time

    # Meet before init so the short timeout below only has to cover the barrier itself.
    me = int(os.environ["RANK"])
    open(os.path.join(meeting, str(me)), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(meeting)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    smp.init({"pipeline_parallel_degree": 1})
    if smp.rank() == 1:
        time.sleep(4)  # never reaches the barrier while rank 0 waits
        return "skipped"
    try:
        smp.barrier()
    except smp.SMPTimeoutError as exc:
        return str(exc)
    return "no timeout"


def test_barrier_timeout_names_what_it_waited_for(tmp_path: Path) -> None:
    out = run_ranks(_one_rank_skips_barrier, 2, str(tmp_path), timeout=30,
                    env={"SMP_FX_TIMEOUT_S": "2"})
    assert out[1] == "skipped"
    assert "timed out waiting for barrier(WORLD)" in out[0] and "rank 0" in out[0]
