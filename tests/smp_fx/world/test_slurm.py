"""SLURM's variables (``srun``), set by hand: compressed host and tasks-per-node lists, and
every rank of a step mapped to the same place torchrun and mpirun give it."""

from __future__ import annotations

import pytest

from cost_model.errors import SMPConfigError
from smp_fx.world import launch, slurm


@pytest.mark.parametrize(("text", "hosts"), [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2],b[09-11]", ["a1", "a2", "b09", "b10", "b11"]),
    ("rack[1-2]-n[3,5]", ["rack1-n3", "rack1-n5", "rack2-n3", "rack2-n5"]),
    ("gpu-a100-[8-9],login", ["gpu-a100-8", "gpu-a100-9", "login"]),
])
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert slurm.expand_hostlist(text) == hosts


def test_expand_counts_and_errors() -> None:
    assert slurm.expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert slurm.expand_counts("4") == [4]
    with pytest.raises(SMPConfigError, match="tasks per node"):
        slurm.expand_counts("2x3")
    with pytest.raises(SMPConfigError, match="host range"):
        slurm.expand_hostlist("node[a-b]")


def _layouts(world: int, per_node: int, nodes: str) -> list[tuple[dict[str, str], ...]]:
    """For each rank: (torchrun env, mpirun env, srun env) of the same placement."""
    hosts = slurm.expand_hostlist(nodes)
    out = []
    for rank in range(world):
        node, local = divmod(rank, per_node)
        torchrun = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": hosts[0],
                    "MASTER_PORT": "29500"}
        mpirun = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
                  "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
                  "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node), "MASTER_ADDR": hosts[0]}
        srun = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world),
                "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
                "SLURM_TASKS_PER_NODE": f"{per_node}(x{world // per_node})",
                "SLURM_JOB_NODELIST": nodes, "SLURM_JOB_ID": "4242"}
        out.append((torchrun, mpirun, srun))
    return out


def test_slurm_mpirun_torchrun_give_the_same_ranks() -> None:
    for torchrun, mpirun, srun in _layouts(8, 4, "node[07-08]"):
        places = [launch.detect(env) for env in (torchrun, mpirun, srun)]
        assert [p.launcher for p in places] == ["torchrun", "mpirun", "slurm"]
        fields = {(p.rank, p.world_size, p.local_rank, p.local_size, p.master_addr,
                   p.master_port) for p in places}
        assert len(fields) == 1, fields
        assert places[2].master_addr == "node07"


def test_slurm_rendezvous_and_uneven_nodes() -> None:
    env = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
           "SLURM_STEP_NODELIST": "gpu[3,5-6]", "SLURM_JOB_NODELIST": "gpu[1-9]"}
    info = launch.detect(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_size) == (4, 5, 0, 1)
    assert info.master_addr == "gpu3"  # the step's first node, not the job's
    moved = launch.detect({**env, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "4000"})
    assert (moved.master_addr, moved.master_port) == ("10.1.2.3", 4000)
    # one task (srun -n 1, or a script run inside an allocation by srun) is a world of one
    alone = launch.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})
    assert alone.launcher == "single"
    # torchrun started by srun (one agent per node) sets RANK: torchrun's view wins
    assert launch.detect({**env, "RANK": "1", "WORLD_SIZE": "2"}).launcher == "torchrun"
    # without SLURM_LOCALID (srun sets it for every task it starts) no SLURM launch is read
    assert launch.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launcher == "single"


def test_bad_slurm_env() -> None:
    with pytest.raises(SMPConfigError, match="SLURM_PROCID"):
        launch.detect({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"})
    with pytest.raises(SMPConfigError, match="rank must be"):
        launch.detect({"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"})
    with pytest.raises(SMPConfigError, match="SLURM_NODEID"):
        launch.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                       "SLURM_NODEID": "3", "SLURM_TASKS_PER_NODE": "2"})
