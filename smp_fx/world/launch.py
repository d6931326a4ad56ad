"""How this process was launched, and joining the default torch.distributed group.

torchrun, mpirun, srun or none, recognised from the environment; reading apart from
joining so ``smp.init`` validates the configuration first. See docs/launch.md, 'How a
process joins, and leaves'.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPConfigError, SMPRuntimeError
from smp_fx.world import slurm

BACKEND_ENV = "SMP_FX_BACKEND"
TIMEOUT_ENV = "SMP_FX_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MASTER_PORT = 29500
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as the launcher told it."""

    launcher: str  # "torchrun" | "mpirun" | "slurm" | "single" | "existing"
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    master_addr: str | None = None
    master_port: int | None = None


def _int_env(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    try:
        return int(text)
    except ValueError as exc:
        raise SMPConfigError.build(f"environment variable {name} must be an integer", text,
                                   "launch", f"unset or fix {name}") from exc


def detect(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, world and local sizes from the launcher's environment (no side effects)."""
    env = os.environ if env is None else env
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_size = (_int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env
                      else world)
        return LaunchInfo("existing", rank, world, local_rank, local_size)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
        local_rank = _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_size = (_int_env(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env
                      else world)
        launcher = "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        rank, world = _int_env(env, "OMPI_COMM_WORLD_RANK"), _int_env(env,
                                                                      "OMPI_COMM_WORLD_SIZE")
        local_rank = (_int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK")
                      if "OMPI_COMM_WORLD_LOCAL_RANK" in env else rank)
        local_size = (_int_env(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
                      if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else world)
        launcher = "mpirun"
    elif slurm.launched_by_srun(env):
        found = slurm.task(env)
        rank, world = found.rank, found.world_size
        local_rank, local_size = found.local_rank, found.local_size
        launcher = "slurm"
        if world == 1:  # srun -n 1: a world of one, joined like a script run alone
            return LaunchInfo("single", 0, 1, 0, 1)
    else:
        return LaunchInfo("single", 0, 1, 0, 1)
    if not 0 <= rank < world:
        raise SMPConfigError.build("rank must be in [0, world size)", (rank, world), launcher,
                                   "check the launcher's environment")
    addr = env.get("MASTER_ADDR")
    if addr is None and launcher == "slurm":
        addr = found.first_host  # rank 0 runs on the step's first node
    if addr is None:
        if local_size < world:
            raise SMPConfigError.build(
                "MASTER_ADDR is required when processes span several nodes", None,
                f"{launcher} rank {rank}", "export MASTER_ADDR=<address of rank 0's node> "
                "(and MASTER_PORT) on every node")
        addr = "127.0.0.1"
    port = _int_env(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
    return LaunchInfo(launcher, rank, world, local_rank, local_size, addr, port)


def choose_backend(requested: str | None = None,
                   env: Mapping[str, str] | None = None) -> str:
    """nccl when CUDA is available, else gloo; ``backend=`` or ``SMP_FX_BACKEND`` override."""
    env = os.environ if env is None else env
    backend = requested or env.get(BACKEND_ENV) or (
        "nccl" if torch.cuda.is_available() else "gloo")
    backend = backend.lower()
    if backend not in BACKENDS:
        raise SMPConfigError.build(f"backend must be one of {', '.join(BACKENDS)}", backend,
                                   f"smp.init(backend=...) / {BACKEND_ENV}", "use gloo or nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise SMPConfigError.build("the nccl backend needs CUDA, which is not available",
                                   backend, "smp.init", "use backend='gloo' on CPU")
    return backend


def timeout(env: Mapping[str, str] | None = None) -> timedelta:
    """The bound on every collective and rendezvous (``SMP_FX_TIMEOUT_S``, default 600 s)."""
    env = os.environ if env is None else env
    text = env.get(TIMEOUT_ENV)
    seconds = DEFAULT_TIMEOUT_S
    if text:
        try:
            seconds = float(text)
        except ValueError as exc:
            raise SMPConfigError.build(f"{TIMEOUT_ENV} must be a number of seconds", text,
                                       "launch", f"fix {TIMEOUT_ENV}") from exc
    return timedelta(seconds=seconds)


def join(info: LaunchInfo, backend: str, wait: timedelta) -> bool:
    """Initialise the default process group for ``info``; return True if this call created it
    (a single process joins an in-memory store)."""
    if info.launcher == "existing":
        return False
    destroy_at_exit()
    if info.launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=wait)
        return True
    # torchrun's agent may already serve the store at MASTER_ADDR:MASTER_PORT; env:// knows
    # (TORCHELASTIC_USE_AGENT_STORE) and joins it as a client. Defaults go through tcp://.
    in_env = "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
    method = "env://" if in_env else f"tcp://{_host(info.master_addr)}:{info.master_port}"
    try:
        store = _attempt_store(wait)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=info.rank,
                                    world_size=info.world_size, timeout=wait)
        else:
            dist.init_process_group(backend, init_method=method, rank=info.rank,
                                    world_size=info.world_size, timeout=wait)
    except (RuntimeError, dist.DistStoreError) as exc:
        raise SMPRuntimeError.build(
            f"could not join the process group within {wait.total_seconds():.0f} s", str(exc),
            f"{info.launcher} rank {info.rank}/{info.world_size} via "
            f"{info.master_addr}:{info.master_port}",
            "check that every rank was launched and MASTER_ADDR/MASTER_PORT agree") from exc
    return True


def _attempt_store(wait: timedelta) -> Any:
    """Under torchrun's restarts, the agent's store with this attempt's prefix (else None), so
    a restart never reads the killed attempt's addresses."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in (None, "0"):
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=wait)
    return dist.PrefixStore(f"smp_fx/attempt{attempt}", client)


_AT_EXIT: list[bool] = []  # whether ``destroy_at_exit`` registered its handler


def destroy_at_exit() -> None:
    """Destroy the default process group at interpreter exit if nobody did: a gloo group left
    to finalization can abort the process (docs/launch.md)."""
    if not _AT_EXIT:
        atexit.register(_destroy_default_group)
        _AT_EXIT.append(True)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _let_backend_threads_finish()


BACKEND_GRACE_S = 0.05


def _let_backend_threads_finish() -> None:
    """Release the GIL for ``BACKEND_GRACE_S`` so gloo's workers free their finished work
    before finalization, which would abort the process (docs/launch.md)."""
    time.sleep(BACKEND_GRACE_S)


def _host(addr: str | None) -> str:
    addr = addr or "127.0.0.1"
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
