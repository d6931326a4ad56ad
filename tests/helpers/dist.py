"""Run a function on N real torch.distributed ranks (separate processes) and collect results.

Each rank is a new process forked from a ``forkserver`` that has imported torch and smp_fx
once and measured this CPU's quick device spec (``tests.helpers.rank_warmup``; fast start
on a loaded machine, and no state inherited from the test process: the server never ran
``smp.init``), with the torchrun environment set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, a free
``MASTER_PORT``), one intra-op thread, and ``SMP_FX_TIMEOUT_S`` equal to the test's
timeout, so ``smp.init()`` inside ``fn`` joins a gloo world exactly as under torchrun.
After ``fn`` the rank forgets smp's state and destroys its process groups, so ``fn`` need
not clean up.

    def _body(scale):            # module level: it is pickled by name
        import smp_fx as smp
        smp.init({"pipeline_parallel_degree": 1})
        return smp.rank() * scale

    assert run_ranks(_body, 2, 10) == [0, 10]

``run_script`` runs a script as ``python script.py args`` would, in one process forked from
the same server (torch and transformers imported already), without the torchrun variables.

A failing rank raises ``RankFailed`` carrying the traceback of the rank that failed first
(the others usually fail because of it: a peer's closed connection, a timeout), then the
ends of the other failed ranks' tracebacks; a rank that does not
report within ``timeout`` seconds raises ``RankFailed`` naming it; a rank listed in
``may_die`` may end without a result (a fault test kills it): its result is None. Every
process is reaped before returning.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import runpy
import socket
import sys
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from typing import Any

FORWARDED = ("SMP_FX_CHECK_ORDER",)
"""Switches read from this process's environment at each call (the forkserver's is the one
it started with), so a test can turn them on with ``monkeypatch.setenv``."""


_DIED = "process exited with code"


class RankFailed(AssertionError):
    """One or more ranks raised, crashed, or did not finish in time."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections and to port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port that was free a moment ago, drawn from below the kernel's ephemeral range:
    a port bound to 0 and released is one the kernel may give the next outgoing connection
    (the other worker's ranks open hundreds), so a launcher could find it taken; a port
    below that range only another explicit pick can take."""
    low = _ephemeral_low()
    rng = random.Random()  # not the global one, which tests seed alike
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn: Callable[..., Any], rank: int, env: dict[str, str], args: tuple[Any, ...],
            out: Any) -> None:
    for key in FORWARDED:  # the forkserver keeps the switches of the run that started it
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(1)
        result = fn(*args)
        out.put((rank, True, result))
    except BaseException:  # report everything, including SystemExit from the code under test
        out.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import sys

            import torch.distributed as dist

            if "smp_fx.world.state" in sys.modules:  # smp's state and groups go first
                from smp_fx.world import state

                state._reset()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              env: Mapping[str, str] | None = None,
              may_die: Collection[int] = ()) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the results ordered by rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "smp_fx",
                                "transformers.modeling_utils", "tests.helpers.rank_warmup"])
    out = ctx.Queue()
    port = free_port()
    forwarded = {k: os.environ[k] for k in FORWARDED if k in os.environ}
    procs = []
    for rank in range(world_size):
        rank_env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                    "SMP_FX_TIMEOUT_S": str(timeout), **forwarded, **dict(env or {})}
        p = ctx.Process(target=_worker, args=(fn, rank, rank_env, args, out), daemon=True)
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    grace_until = deadline
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if errors:  # the others are likely blocked on the failed rank: short grace
                left = min(left, grace_until - time.monotonic())
            if left <= 0:
                break
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in results and r not in errors]
                for r in dead:
                    if r in may_die:
                        results[r] = None
                        continue
                    errors[r] = f"{_DIED} {procs[r].exitcode} without a result"
                    grace_until = min(grace_until, time.monotonic() + 3.0)
                continue
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
            if not ok and len(errors) == 1:
                grace_until = time.monotonic() + 3.0
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise RankFailed(_failure_report(errors, world_size))
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RankFailed(f"ranks {missing} of {world_size} did not finish within {timeout} s")
    return [results[r] for r in range(world_size)]


def _failure_report(errors: dict[int, str], world_size: int, tail: int = 12) -> str:
    """The first failed rank's traceback in full and the last ``tail`` lines of the others',
    in the order they failed (``errors`` keeps arrival order; a process that died without a
    report, seen only once the queue is quiet, goes first): the first is most often the
    cause, the others its peers' "connection closed" or timeout."""
    order = sorted(errors, key=lambda r: not errors[r].startswith(_DIED))
    first = order[0]
    parts = [f"{len(errors)} of {world_size} ranks failed (in this order: {order}); "
             f"rank {first}, the first:\n{errors[first]}"]
    for rank in order[1:]:
        lines = errors[rank].rstrip().splitlines()
        parts.append(f"rank {rank} (last {min(tail, len(lines))} lines):\n"
                     + "\n".join(lines[-tail:]))
    return "\n".join(parts)


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


def _script_main(script: str, argv: list[str], env: dict[str, str],
                 unset: tuple[str, ...], cwd: str) -> None:
    for key in (*TORCHRUN_VARS, *unset):
        os.environ.pop(key, None)
    os.environ.update(env)
    os.chdir(cwd)  # not the folder the forkserver started in, which a test may have removed
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # as ``python script.py`` puts it first
    runpy.run_path(script, run_name="__main__")


def run_script(script: str, *argv: str, env: Mapping[str, str] | None = None,
               unset: Collection[str] = (), cwd: str | None = None,
               timeout: float = 300.0) -> None:
    """Run ``script`` as its own one-process job (``__main__``, ``sys.argv``) forked from
    the forkserver, which saves a fresh interpreter's imports of torch and transformers;
    ``env`` added and ``unset`` removed from its environment, in ``cwd`` (the repository's
    root by default). Raises ``RankFailed`` with its traceback if it raises."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_ranks(_script_main, 1, str(script), list(argv), dict(env or {}), tuple(unset),
              cwd or root, timeout=timeout)


def each_on_one_world(cases: Mapping[Any, Callable[[], Any]],
                      failed: Callable[[str], Any]) -> dict[Any, Any]:
    """Inside a rank: every case in turn on one gloo world (joined once: re-initialising
    gloo inside one spawn races on the store), each after smp's state is reset; a case that
    raises gives ``failed(its traceback)``, so the others still run and report."""
    import torch.distributed as dist

    from smp_fx.world import state

    dist.init_process_group("gloo")
    out: dict[Any, Any] = {}
    for name, run in cases.items():
        state._reset()
        try:
            out[name] = run()
        except Exception:
            out[name] = failed(traceback.format_exc())
    return out
