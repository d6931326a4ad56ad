"""Elastic restarts: a job under a node range goes on at whatever world torchelastic gives it.

``smp-fx run --nnodes MIN:MAX`` exports the full world (MAX nodes x processes per node).
At ``smp.init`` pp, tp and cp are kept, data parallelism is the world's share, and
``microbatches`` grows by full dp / dp, so a microbatch keeps its size while each rank takes
a larger share of the same global batch; one line on rank 0 says so. The launcher also makes
every rendezvous round publish a fresh store (see ``launch_env``). docs/faults.md, 'Elastic
resume'.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from cost_model.errors import SMPConfigError
from smp_fx.config import SMPConfig

FULL_WORLD_ENV = "SMP_FX_FULL_WORLD_SIZE"
# torchelastic's switch: each round's rank 0 starts a new store on a new port
NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def node_range(nnodes: str | None) -> tuple[int, int] | None:
    """(MIN, MAX) of ``--nnodes MIN:MAX``; None for a fixed count or none."""
    if nnodes is None or ":" not in str(nnodes):
        return None
    low, _, high = str(nnodes).partition(":")
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise SMPConfigError.build("--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX", nnodes,
                                   "smp-fx run", "pass e.g. --nnodes 1:2")
    return int(low), int(high)


def launch_env(nnodes: str | None, nproc: int, restarts: bool) -> dict[str, str]:
    """Environment of a multi-node launch: the full world under a node range; under a range
    or restarts, no store shared across rendezvous rounds (torchelastic's shared store keeps
    the keys of earlier rounds, and a node joining a later round waits forever for a
    MASTER_ADDR no one publishes again)."""
    found = node_range(nnodes)
    added: dict[str, str] = {}
    if found is not None:
        added[FULL_WORLD_ENV] = str(found[1] * nproc)
    if found is not None or restarts:
        added[NO_SHARED_STORE_ENV] = "1"
    return added


def check_range(config: SMPConfig, nnodes: str | None, nproc: int) -> None:
    """Every node count of the range must hold pp x tp x cp, or a shrink would fail later."""
    found = node_range(nnodes)
    if found is None:
        return
    mp = model_parallel_size(config)
    bad = [n for n in range(found[0], found[1] + 1) if (n * nproc) % mp]
    if bad:
        raise SMPConfigError.build(
            f"every node count of --nnodes must give a multiple of pipeline x tensor x context "
            f"parallel degrees = {mp} processes", f"{bad[0]} nodes x {nproc} = {bad[0] * nproc}",
            "smp-fx run", f"use -n a multiple of {mp}, or a node range without {bad}")


def shared_store_advice(env: Mapping[str, str] | None = None) -> str | None:
    """A line for several nodes under torchrun's restarts with the store shared across rounds:
    a node that joins a later round (one returning) then waits forever."""
    env = os.environ if env is None else env
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or env.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0"
            or env.get("GROUP_WORLD_SIZE", "1") == "1"):
        return None
    return (f"smp-fx: torchrun shares its rendezvous store across rounds, so a node joining a "
            f"later round cannot join: export {NO_SHARED_STORE_ENV}=1 before torchrun "
            "(smp-fx run does) for restarts across nodes")


def model_parallel_size(config: SMPConfig) -> int:
    return (config.pipeline_parallel_degree * config.tensor_parallel_degree
            * config.context_parallel_degree)


def adjust(config: SMPConfig, world: int,
           env: Mapping[str, str] | None = None) -> tuple[SMPConfig, str | None]:
    """(the configuration to run at ``world``, the line that says what changed, or None)."""
    env = os.environ if env is None else env
    text = env.get(FULL_WORLD_ENV, "")
    if not text.isdigit():
        if text:
            raise SMPConfigError.build(f"{FULL_WORLD_ENV} must be a whole number", text,
                                       "smp.init", f"unset {FULL_WORLD_ENV} (smp-fx run sets it)")
        return config, None
    full, mp = int(text), model_parallel_size(config)
    if full <= world:
        return config, None
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if world % mp:
        raise SMPConfigError.build(
            f"{world} processes cannot hold pipeline x tensor x context parallel degrees = "
            f"{mp}", world, f"smp.init after an elastic restart (attempt {attempt}, full world "
            f"{full})", f"bring nodes back, or launch with a node range every size of which "
            f"gives a multiple of {mp} processes")
    dp, full_dp = world // mp, full // mp
    m = config.microbatches
    kept = (f"pp {config.pipeline_parallel_degree} x tp {config.tensor_parallel_degree}"
            + (f" x cp {config.context_parallel_degree}" if config.context_parallel_degree > 1
               else ""))
    head = f"smp-fx elastic: {world} of {full} processes: {kept} kept, dp {dp} (full {full_dp})"
    if full_dp % dp:
        return config, (f"{head}; microbatches stay {m}, so each is {full_dp / dp:g}x larger "
                        "when the script takes global batch / smp.dp_size() per rank")
    scaled = dataclasses.replace(config, microbatches=m * (full_dp // dp))
    return scaled, (f"{head}; microbatches {m} -> {scaled.microbatches}, their size kept: "
                    "the global batch is kept when the script takes global batch / "
                    "smp.dp_size() rows per rank")
