"""SLURM's view of a job step launched by ``srun``: ranks, sizes and the rendezvous host
(the list's first node), as pure functions of the environment.

>>> expand_hostlist("node[01-03,07],login")
['node01', 'node02', 'node03', 'node07', 'login']
>>> expand_counts("2(x3),1")
[2, 2, 2, 1]
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from cost_model.errors import SMPConfigError

NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
REQUIRED = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@dataclass(frozen=True)
class SlurmTask:
    """What SLURM says about this task."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    first_host: str | None


def launched_by_srun(env: Mapping[str, str]) -> bool:
    """A task of an ``srun`` step: the three variables it sets for every task are there."""
    return all(name in env for name in REQUIRED)


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (x.strip() for x in parts) if p]


def _expand_range(spec: str, where: str) -> list[str]:
    out: list[str] = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SMPConfigError.build("a SLURM host range must be numbers like 01-03", item,
                                       where, "check the node list SLURM set")
        width = len(lo)  # node[01-10]: the zero padding of the first bound
        first, last = int(lo), int(hi) if hi else int(lo)
        out += [str(n).zfill(width) for n in range(first, last + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list as host names, in order: ``a[1-2]b[3,5]`` is the
    product ``a1b3, a1b5, a2b3, a2b5``; plain names stay as they are."""
    hosts: list[str] = []
    for part in _split_top(text):
        pieces: list[list[str]] = []
        for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            if literal:
                pieces.append([literal])
            if bracket:
                pieces.append(_expand_range(bracket, f"host list {text!r}"))
        hosts += ["".join(combo) for combo in itertools.product(*pieces)]
    return hosts


def expand_counts(text: str) -> list[int]:
    """SLURM's compressed tasks-per-node list (``2(x3),1``) as one count per node."""
    counts: list[int] = []
    for item in _split_top(text):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if match is None:
            raise SMPConfigError.build("SLURM tasks per node must look like 2(x3),1", text,
                                       "SLURM_TASKS_PER_NODE", "check the environment srun set")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError as exc:
        raise SMPConfigError.build(f"environment variable {name} must be an integer",
                                   env[name], "SLURM launch", f"unset or fix {name}") from exc


def task(env: Mapping[str, str]) -> SlurmTask:
    """This task's place in the step (``launched_by_srun(env)`` must hold)."""
    rank, world, local_rank = (_int(env, n) for n in REQUIRED)
    local_size = world
    per_node = next((env[n] for n in TASKS_PER_NODE_VARS if env.get(n)), None)
    if per_node is not None:
        counts = expand_counts(per_node)
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        if not 0 <= node < len(counts):
            raise SMPConfigError.build("SLURM_NODEID is not a node of the step",
                                       (node, per_node), "SLURM launch",
                                       "check the environment srun set")
        local_size = counts[node]
    nodelist = next((env[n] for n in NODELIST_VARS if env.get(n)), None)
    first = expand_hostlist(nodelist)[0] if nodelist else None
    return SlurmTask(rank, world, local_rank, local_size, first)
