"""Asynchronous checkpoints: ``save_checkpoint(..., async_save=True)``, ``smp.wait_checkpoint``.

A synchronous save stalls every rank for the whole write. An asynchronous one does at the
call only what needs the other ranks or the live tensors (``checkpoint_api``: one gather, a
copy of the state off the training tensors by ``smp_fx.ckpt.snapshot``); the background
writer here takes the copies it was left, waits for the next step (``hold_writes``), then
writes this rank's files into the staging folder (``smp_fx.ckpt.direct_io``) and a
done-marker beside them, while training goes on. It never communicates, so it cannot
interleave with training collectives. The ranks agree on their writers where all pass
alike: each ``smp.step`` while a save is in flight (an all-reduce launched at its start,
acted on at its end), the next save or resume, and ``smp.wait_checkpoint()``. Once every
rank's part is written, world rank 0 commits (the staging folder renamed, ``newest``
rewritten, rotation) on a thread of its own, and the next agreement says how that went; a
failed write or commit is raised there on every rank. At process exit each rank waits for
its writer; rank 0 then commits if every rank's done-marker says its part is written. At
most one save is in flight: the next one waits. Until the commit ``newest`` names the
previous checkpoint, so a crash anywhere keeps it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPCheckpointError
from smp_fx.ckpt.direct_io import lean_serialization, write_direct
from smp_fx.ckpt.view import Ranks
from smp_fx.world import comm, launch

log = logging.getLogger(__name__)

MARKER = ".done_rank"  # + the world rank: a rank's part of the staging folder is written
OK = "ok"

write_file = write_direct
"""How the writer thread writes one file (tests replace it: a full disk, a write held
half-written while a rank is killed)."""


def write(path: str, writer: Callable[[IO[bytes]], object]) -> None:
    """One file of an asynchronous save, atomically (through ``write_file``)."""
    write_file(path, writer)


HOLD_S = 3.0  # the longest the writer waits for the next step before writing anyway


class Job:
    """One asynchronous save in flight on this rank: its copies, writes, commit (world rank
    0) and their outcome."""

    def __init__(self, name: str, folder: str | None, ranks: Ranks,
                 writes: list[Callable[[], None]], commit: Callable[[], None],
                 ready: Callable[[], None]) -> None:
        self.name, self.folder, self.ranks = name, folder, ranks
        self.rank, self.world = (0, 1) if ranks.alone else (ranks.rank, ranks.world_size)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.go = threading.Event()  # set: write now (``hold_writes``)
        self.steps = 0  # smp.step starts seen since the save began
        self.committing = False  # every rank's part written: world rank 0 commits
        self.began = time.monotonic()
        self._writes, self._commit, self._ready = writes, commit, ready
        self._thread = threading.Thread(target=self._run, name="smp-fx-checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            lean_serialization()
            self._ready()
            hold_writes(self)
            for write in self._writes:
                write()
            self._mark(OK)
        except BaseException as exc:  # kept for the next boundary, raised there on every rank
            self.error = exc
            try:
                self._mark(f"{type(exc).__name__}: {exc}")
            except OSError:
                pass
        finally:
            self._writes = []  # the copies go as soon as they are written
            self.done.set()

    def marker(self, rank: int) -> str:
        return os.path.join(self.folder or "", f"{MARKER}{rank}")

    def _mark(self, text: str) -> None:
        if self.folder is not None:
            data = text.encode()
            write(self.marker(self.rank), lambda fh: fh.write(data))

    def state(self) -> int:
        """0: writing (or committing), 1: written (committed), 2: failed."""
        return 0 if not self.done.is_set() else 1 if self.error is None else 2

    def commit(self) -> None:
        """World rank 0: the markers go, then the caller's commit."""
        if self.folder is not None:
            for r in range(self.world):
                try:
                    os.unlink(self.marker(r))
                except FileNotFoundError:
                    pass
        self._commit()

    def commit_in_background(self) -> None:
        """Every rank's part is written: from now on ``state`` says how the commit goes,
        which world rank 0 runs on a thread of its own (``commit_off_the_step``)."""
        self.committing = True
        if self.rank != 0:
            return
        self.done.clear()
        threading.Thread(target=self._run_commit, name="smp-fx-checkpoint-commit",
                         daemon=True).start()

    def _run_commit(self) -> None:
        try:
            self.commit()
        except BaseException as exc:  # raised at the next boundary on every rank
            self.error = exc
        finally:
            self.done.set()


def hold_writes(job: Job) -> None:
    """The writer, its copies taken, waits for the start of the step after the one that
    started the save (or ``HOLD_S``, or a wait for the save) before it writes: the step
    that starts a save then carries the copy alone, and the writing runs beside the next
    step: the writer's CPU in that step 0.027 -> 0.013 s on rank 0 at pp 2 x dp 2
    (``benchmarks/async_checkpoint.py``), its disk burst a step later."""
    job.go.wait(HOLD_S)


_inflight: Job | None = None
_agreement: tuple[Any, torch.Tensor] | None = None  # launched at a step's start (below)
_at_steps = True  # whether the step boundary agrees (not after join(): uneven step counts)


def stop_at_steps() -> None:
    """``DistributedModel.join()`` was entered: ranks out of data make no more steps, so
    from now on only saves, resumes and ``smp.wait_checkpoint()`` agree and commit."""
    global _at_steps
    _at_steps = False
    if _inflight is not None:
        _inflight.go.set()


def at_step() -> None:
    """The start of an ``smp.step`` while a save is in flight: release its writes from the
    second step on (``hold_writes``), and launch the writers' agreement
    (``agree_in_background``; alone: ``settle`` without waiting)."""
    job = _inflight
    if not _at_steps or job is None:
        return
    job.steps += 1
    if job.steps >= 2:
        job.go.set()
    if job.ranks.alone:
        settle(block=False)
        return
    _drain()  # a step that raised before its end left one
    agree_in_background()


def after_step() -> None:
    """The end of an ``smp.step``: act on the agreement its start launched (commit the save
    written everywhere, or raise its failure on every rank)."""
    global _agreement
    if _agreement is None or _inflight is None:
        _agreement = None
        return
    work, counts = _agreement
    _agreement = None
    work.wait()
    writing, failed = (int(c) for c in counts.tolist())
    _decide(_inflight, failed > 0, writing > 0)


def agree_in_background() -> None:
    """Launch the writers' agreement as one asynchronous all-reduce of two counts (ranks
    writing, ranks failed) at a step's start, awaited at its end (``after_step``), when it
    is long complete. A blocking all-gather of the writers' states at the start instead
    made every step in flight wait for the slowest rank's previous step: 0.03 s a step
    (5 % of a 0.5 s step) at pp 2 x dp 2 in ``benchmarks/async_checkpoint.py``."""
    global _agreement
    assert _inflight is not None
    mine = _inflight.state()
    counts = torch.tensor([int(mine == 0), int(mine == 2)], dtype=torch.int64)
    group = _inflight.ranks.object_group(comm.WORLD.axis)
    _agreement = (dist.all_reduce(counts, group=group, async_op=True), counts)


def _drain() -> None:
    """Wait for an agreement launched and not acted on (every rank launched it alike)."""
    global _agreement
    if _agreement is not None:
        _agreement[0].wait()
        _agreement = None


def start(name: str, folder: str | None, ranks: Ranks, writes: list[Callable[[], None]],
          commit: Callable[[], None], ready: Callable[[], None]) -> None:
    """Write ``writes`` in the background as the save ``name`` (the caller settled the
    previous one): ``folder``, a partial save's staging folder, gets the done-markers;
    ``commit`` is world rank 0's once all are written; ``ready`` waits for the copies."""
    global _inflight
    _inflight = Job(name, folder, ranks, writes, commit, ready)


def settle(block: bool, next_tag: str | None = None) -> None:
    """The boundary of the module doc: every rank shares its writer's state; a failure is
    raised on every rank, a save written everywhere is committed. ``block``: wait for this
    rank's writer and the commit. Collective when a save is in flight (every rank has one
    then)."""
    job = _inflight
    if job is None:
        return
    _drain()
    if block:
        job.go.set()
        if not job.done.is_set() and next_tag is not None:
            log.warning("smp.save_checkpoint(%r) waits for the asynchronous checkpoint %s "
                        "to finish writing (one save in flight at a time)", next_tag, job.name)
    while _inflight is job:
        if block:
            job.done.wait()
        gather = job.ranks.world_gather()
        states = [job.state()] if gather is None else gather(job.state())
        _decide(job, 2 in states, 0 in states)
        if not block:
            return


def _decide(job: Job, failed: bool, writing: bool) -> None:
    """What every rank does once the ranks agreed on their writers (alike on every rank):
    raise a failure anywhere, wait while any writes, else start the commit (world rank 0,
    ``commit_off_the_step``), or, once it is done, forget the save."""
    global _inflight
    if failed:
        _inflight = None
        gather = job.ranks.world_gather()
        said = str(job.error) if job.error is not None else None
        messages = [said] if gather is None else gather(said)
        told = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
        raise SMPCheckpointError.build(
            f"the asynchronous checkpoint {job.name} was not "
            f"{'committed' if job.committing else 'written'}", told,
            where="raised at the next step, save or wait on every rank",
            fix="free space or fix the cause, then save again; the previous checkpoint is "
            "unchanged and still the newest") from job.error
    if writing:
        return
    if not job.committing:
        commit_off_the_step(job)
        return
    _inflight = None
    log.info("asynchronous checkpoint %s committed, %.1f s after the save began", job.name,
             time.monotonic() - job.began)


def commit_off_the_step(job: Job) -> None:
    """Every rank's part is written: world rank 0 commits on a thread of its own, and the
    next agreement (the next step's, or a wait's) says how it went, a failure raised on
    every rank there. Committing on the main thread, then agreeing at once (a blocking
    gather), cost the ranks of pipeline stage 1 0.13 s once per save at pp 2 x dp 2
    (``benchmarks/async_checkpoint.py``), waiting for stage 0 and rank 0's fsyncs."""
    job.commit_in_background()


def wait_checkpoint() -> None:
    """Wait until the asynchronous checkpoint in flight (if any) is written on every rank
    and committed; raise its failure, if it failed, on every rank. Collective: call it on
    every rank (e.g. before the script ends, or before reading the checkpoint).

    Example::

        smp.save_checkpoint("/ckpt", tag=f"step{step}", model=model, optimizer=optimizer,
                            async_save=True)
        ...                       # training goes on while it is written
        smp.wait_checkpoint()     # newest now names it
    """
    settle(block=True)


def in_flight() -> str | None:
    """The name of the asynchronous checkpoint this rank is writing or has not yet
    committed (None: none)."""
    return None if _inflight is None else _inflight.name


def _at_exit() -> None:
    """Process exit: wait for this rank's writer; rank 0 commits when every rank's marker
    says its part is written (no collective: the other ranks may be gone), or waits for the
    commit it began."""
    job = _inflight
    if job is None:
        return
    job.go.set()
    bound = launch.timeout().total_seconds()
    if not job.done.wait(bound) or job.error is not None:
        log.error("the asynchronous checkpoint %s was not %s on rank %d (%s); the "
                  "previous checkpoint stays the newest", job.name,
                  "committed" if job.committing else "written", job.rank,
                  job.error or f"still writing after {bound:.0f} s")
        return
    if job.rank != 0 or job.committing:
        return
    # the other ranks write alike: a marker missing long after this rank's own write is
    # done belongs to a rank that is gone (killed), not slow
    took = time.monotonic() - job.began
    deadline = time.monotonic() + min(bound, max(60.0, 2 * took))
    while True:
        marks = [_read_marker(job, r) for r in range(job.world)] if job.folder else [OK]
        if all(m == OK for m in marks):
            job.commit()
            return
        failed = [r for r, m in enumerate(marks) if m is not None and m != OK]
        if failed or time.monotonic() > deadline:
            log.error("the asynchronous checkpoint %s is not committed: rank(s) %s did not "
                      "write their part; the previous checkpoint stays the newest", job.name,
                      failed or [r for r, m in enumerate(marks) if m is None])
            return
        time.sleep(0.1)


def _read_marker(job: Job, rank: int) -> str | None:
    try:
        with open(job.marker(rank), encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


atexit.register(_at_exit)
