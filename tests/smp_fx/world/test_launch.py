"""Launcher detection (torchrun, mpirun, none), backend choice, timeouts, reuse of a process
group the user created, and the smddp backend."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import smp_fx as smp
from cost_model.errors import SMPConfigError
from smp_fx.world import launch, smddp, state

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}


def test_torchrun_env() -> None:
    info = launch.detect(TORCHRUN)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_size,
            info.master_addr, info.master_port) == ("torchrun", 3, 8, 1, 4, "10.0.0.1", 1234)


def test_mpirun_env_defaults_master_on_one_node() -> None:
    info = launch.detect(MPIRUN)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_size,
            info.master_addr, info.master_port) == ("mpirun", 5, 8, 1, 8, "127.0.0.1", 29500)


def test_mpirun_multi_node_needs_master_addr() -> None:
    env = {**MPIRUN, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    with pytest.raises(SMPConfigError, match="MASTER_ADDR is required"):
        launch.detect(env)
    assert launch.detect({**env, "MASTER_ADDR": "h0"}).master_addr == "h0"


def test_no_launcher_is_a_world_of_one() -> None:
    info = launch.detect({})
    assert (info.launcher, info.rank, info.world_size, info.local_size) == ("single", 0, 1, 1)


@pytest.mark.parametrize("env", [{"RANK": "x", "WORLD_SIZE": "2"},
                                 {"RANK": "2", "WORLD_SIZE": "2"}])
def test_bad_launcher_env(env: dict[str, str]) -> None:
    with pytest.raises(SMPConfigError, match="RANK|rank must be"):
        launch.detect(env)


def test_backend_choice() -> None:
    default = "nccl" if torch.cuda.is_available() else "gloo"
    assert launch.choose_backend(None, {}) == default
    assert launch.choose_backend(None, {"SMP_FX_BACKEND": "GLOO"}) == "gloo"
    assert launch.choose_backend("gloo", {"SMP_FX_BACKEND": "nccl"}) == "gloo"
    with pytest.raises(SMPConfigError, match="backend must be"):
        launch.choose_backend("mpi", {})
    if not torch.cuda.is_available():
        with pytest.raises(SMPConfigError, match="needs CUDA"):
            launch.choose_backend("nccl", {})


def test_timeout_env() -> None:
    assert launch.timeout({}) == timedelta(seconds=600)
    assert launch.timeout({"SMP_FX_TIMEOUT_S": "2.5"}) == timedelta(seconds=2.5)
    with pytest.raises(SMPConfigError, match="SMP_FX_TIMEOUT_S"):
        launch.timeout({"SMP_FX_TIMEOUT_S": "soon"})


def test_reuses_user_process_group_and_leaves_it() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        smp.init({"pipeline_parallel_degree": 1, "ddp": True})
        st = state.get()
        assert st.launch.launcher == "existing" and not st.owns_default_group
        state._reset()
        with pytest.raises(SMPConfigError, match="another backend"):
            smp.init({"pipeline_parallel_degree": 1}, backend="nccl")
        smp.init({"pipeline_parallel_degree": 1, "ddp": True})
        st = state.get()
        assert st.backend == "gloo" and st.device == (torch.device("cuda", 0)
                                                      if torch.cuda.is_available()
                                                      else torch.device("cpu"))
        state._reset()
        assert dist.is_initialized()  # the user's group survives smp's reset
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_config_errors_come_before_joining() -> None:
    with pytest.raises(SMPConfigError, match="unknown configuration parameter"):
        smp.init({"pipeline_parallel_degree": 1, "pipline": "simple"})
    assert not dist.is_initialized() and not smp.is_initialized()


def test_smddp_backend_single_process() -> None:
    smddp.register()
    smddp.register()  # idempotent
    assert smddp.is_registered()
    dist.init_process_group("smddp", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert dist.get_backend() == "smddp" and t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
