"""The torch.distributed transport: pytrees arrive intact, header caching and the frame
layout stay in step across header changes and receives posted ahead, frames are reused only
when free, waits are bounded."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import smp_fx as smp
from smp_fx.runtime.transport.dist_transport import DistTransport
from tests.helpers.compare import Checks
from tests.helpers.dist import run_ranks

BIG = torch.arange(300 * 300.0).view(300, 300)  # over the frame limit: its own message
MESSAGES: list[Any] = [
    (torch.arange(6.0).view(2, 3), 4),
    (torch.arange(6.0).view(2, 3) + 1, 4),          # same header: one frame
    (None, 4),                                       # new header, small frame
    (torch.arange(6.0).view(2, 3) + 2, 4),           # and back
    (torch.ones(3, 2, dtype=torch.float64), None),   # new header: fill frame first
    {"a": [torch.tensor([1, 2]), "x"], "b": None},   # new structure
    {"a": [torch.tensor([3, 4]), "x"], "b": None},   # repeated again
    (BIG, torch.zeros(0), torch.tensor([True, False]), torch.arange(12.0).view(3, 4).t()),
    (BIG + 1, torch.zeros(0), torch.tensor([False, True]), torch.ones(4, 3)),
    (None, "x"),                                     # fills the large tensor's receive too
    (torch.ones(2, requires_grad=True), BIG.double()),
    (torch.ones(2), BIG.double().requires_grad_()),  # a large tensor that requires grad,
    (torch.ones(2), (BIG + 2).double().requires_grad_()),  # its receive posted ahead
    ([torch.ones(2), None], (torch.zeros(1),)),      # flattened by hand: lists, None
    ([torch.ones(2) * 3, None], (torch.ones(1),)),
    ([None, torch.ones(2)], (torch.ones(1),)),       # another structure, same tensors
    (torch.zeros(2), 1),
    (torch.zeros(2), True),                          # 1 == True, yet a new header
    # One tensor: sent as itself (``wire.direct_layout``), whatever its size or layout.
    (BIG.t(),),                                      # large and not contiguous
    (BIG + 3,),                                      # same header, contiguous
    (torch.arange(6.0).view(2, 3).t(),),             # small and not contiguous
    (torch.ones(3, dtype=torch.bfloat16) / 3,),
    (torch.ones(3, dtype=torch.float16) / 3,),
    (torch.tensor([True, False, True]),),
    (torch.tensor(2.5),),                            # no dimensions
    (torch.arange(4.0) * (1 + 2j),),                  # complex: sent as its real view
    (torch.ones(5, requires_grad=True),),
    (torch.full((5,), 7.0, requires_grad=True),),    # same header again
]


def _same(got: Any, msg: Any) -> bool:
    flat_a, flat_b = torch.utils._pytree.tree_flatten(got), torch.utils._pytree.tree_flatten(msg)
    return flat_a[1] == flat_b[1] and all(
        torch.equal(x, y) and x.requires_grad == y.requires_grad
        if isinstance(x, torch.Tensor) else
        (x == y and type(x) is type(y)) for x, y in zip(flat_a[0], flat_b[0]))


def _body() -> tuple[int, list[str]]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = DistTransport.make_groups()
    tr = DistTransport([0, 1], rank, torch.device("cpu"), 30.0, groups)
    ok = Checks()

    # Receives posted ahead ("out" always, "act" under gloo: every message of the step),
    # across header changes (all later ones posted in the old layout, then skipped); in the
    # second step the sender is late.
    outstanding = []
    inner = tr._recv

    def counting(posted: Any, queue: Any, *args: Any) -> Any:
        outstanding.append(len(queue))
        return inner(posted, queue, *args)

    tr._recv = counting  # type: ignore[method-assign]
    for delay in (0.0, 0.01):
        if rank == 1:
            tr.prefetch(0, 1, "out", len(MESSAGES))
            tr.prefetch(0, 1, "act", len(MESSAGES))
        else:
            tr.plan_sends(0, 1, "act", len(MESSAGES))
            tr.plan_sends(0, 1, "out", len(MESSAGES))
        for i, msg in enumerate(MESSAGES):
            out_msg = MESSAGES[-1 - i]
            if rank == 0:
                time.sleep(delay)
                tr.send(msg, 0, 1, "act", i)
                tr.send(out_msg, 0, 1, "out", i)  # another channel
            else:
                got = tr.recv(0, 1, "act", i)
                out = tr.recv(0, 1, "out", i)
                ok.expect(_same(got, msg) and _same(out, out_msg), f"message {i} (delay {delay})")
        tr.finish()
        dist.barrier()
    if rank == 1:  # every message of the step posted at prefetch, and again after a change
        ok.expect(max(outstanding) == len(MESSAGES) - 1, "all messages posted ahead")
        ok.expect(tr._got[(0, 1, "act")].direct and tr._got[(0, 1, "out")].direct,
                  "one-tensor messages travel as themselves")
    _chunk_streams(rank, ok)
    if rank == 1:
        short = DistTransport([0, 1], 1, torch.device("cpu"), 0.5, groups)
        short.where = lambda: "rank 1 (stage 1) in step 0, while receiving microbatch 7"
        try:
            short.recv(0, 1, "grad", 7)
        except Exception as exc:  # noqa: BLE001
            ok.expect(isinstance(exc, smp.SMPTimeoutError) and exc.peer_rank == 0
                      and "stage 0 (rank 0) sent nothing for 0.5 s" in str(exc)
                      and "while receiving microbatch 7" in str(exc),
                      "timeout names what it waited for")
    dist.barrier()
    return ok.report()


# Chunks placed as a V (stages 0 and 3 on rank 0, 1 and 2 on rank 1): stage 0 sends to two
# chunks of rank 1 (a skip connection), and stages 0 and 3 both send to stage 1; each stream
# with headers of its own, received in another order than sent.
V_RANKS, V_LANES = [0, 1, 1, 0], (0, 0, 1, 1)
V_STREAMS = ((0, 1), (0, 2), (3, 1))


def _v_message(stream: int, i: int) -> Any:
    if stream == 0:
        return (torch.full((2, 3), float(i)), torch.tensor([i, 1]))
    if stream == 1:
        return ({"mask": torch.tensor([True, i % 2 == 0])}, BIG + i, "x" * i)
    return (torch.full((5,), float(-i), dtype=torch.float64), None)


def _chunk_streams(rank: int, ok: Checks) -> None:
    tr = DistTransport(V_RANKS, V_RANKS.index(rank), torch.device("cpu"),
                       30.0, DistTransport.make_groups(lanes=2), V_LANES)
    n = 3
    for src, dst in V_STREAMS:
        if rank == 0:
            tr.plan_sends(src, dst, "act", n)
        else:
            tr.prefetch(src, dst, "act", n)
    if rank == 0:  # interleaved, one message of every stream in turn
        for i in range(n):
            for k, (src, dst) in enumerate(V_STREAMS):
                tr.send(_v_message(k, i), src, dst, "act", i)
    else:  # stream by stream, the last first
        for k, (src, dst) in reversed(list(enumerate(V_STREAMS))):
            for i in range(n):
                got = tr.recv(src, dst, "act", i)
                ok.expect(_same(got, _v_message(k, i)), f"chunk stream {src}->{dst} message {i}")
    tr.finish()


@pytest.mark.multiproc
def test_dist_transport_round_trips_and_times_out() -> None:
    _, report = run_ranks(_body, 2, timeout=90)
    assert report == (2 * len(MESSAGES) + 3 + len(V_STREAMS) * 3, [])


def _two_messages(tr: DistTransport, rank: int, step: int, shape: tuple[int, ...],
                  ok: Checks, tensors: int = 1) -> list[torch.Tensor]:
    """Rank 0 sends step ``step``'s two activations of ``tensors`` tensors each (one: no
    frame, ``wire.direct_layout``); rank 1 receives them, checks their values into ``ok``
    and returns their first tensors."""
    got = []
    for i in range(2):
        value = tuple(torch.full(shape, float(10 * step + i + k)) for k in range(tensors))
        if rank == 0:
            tr.send(value, 0, 1, "act", i)
        else:
            msg = tr.recv(0, 1, "act", i)
            got.append(msg[0])
            ok.expect(all(torch.equal(a, b) for a, b in zip(msg, value, strict=True)),
                      f"step {step} message {len(got) - 1}")
    return got


def _reuse_body() -> tuple[int, list[str]]:
    """Frames are reused across steps, never while a received tensor still views them."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tr = DistTransport([0, 1], rank, torch.device("cpu"), 30.0, DistTransport.make_groups())
    ok = Checks()
    kept: list[torch.Tensor] = []
    ptrs: list[int] = []
    for step in range(4):
        if rank == 1:
            tr.prefetch(0, 1, "act", 2)
        else:
            tr.plan_sends(0, 1, "act", 2)
        for got in _two_messages(tr, rank, step, (32, 64), ok):
            ptrs.append(got.data_ptr())
            if step == 1:
                kept.append(got)  # views of step 1's frames stay alive
        tr.finish()
        dist.barrier()
    if rank == 1:
        ok.expect(all(torch.equal(k, torch.full((32, 64), float(10 + i)))
                      for i, k in enumerate(kept)), "kept tensors keep their values")
        ok.expect(ptrs[4] == ptrs[0] or ptrs[4] == ptrs[1], "step 2 reuses step 0's frames")
        ok.expect(not set(ptrs[4:]) & set(ptrs[2:4]), "kept tensors' frames not reused")
    dist.barrier()
    return ok.report()


@pytest.mark.multiproc
def test_dist_transport_reuses_frames_only_when_free() -> None:
    _, report = run_ranks(_reuse_body, 2, timeout=90)
    assert report == (11, [])


def _send_frames_body() -> tuple[int, list[str]]:
    """A sent frame is reused by the same message of the next step, but only after
    ``finish`` saw the last step's sends complete (a failed step never calls it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tr = DistTransport([0, 1], rank, torch.device("cpu"), 30.0, DistTransport.make_groups())
    ok = Checks()
    frames: list[list[int]] = []
    for step in range(4):
        _two_messages(tr, rank, step, (8, 8), ok, tensors=2)
        if rank == 0:
            frames.append([f.frame.data_ptr() for f in tr._send_frames[(0, 1, "act")]])
        if step != 1 or rank == 1:  # rank 0's step 1 fails before its finish
            tr.finish()
        dist.barrier()
    if rank == 0:
        ok.expect(len(frames[0]) == 2 and frames[1][:2] == frames[0], "step 1 reuses frames")
        ok.expect(len(frames[2]) == 4, "step 2 takes new frames (step 1's not seen done)")
        ok.expect(frames[3] == frames[2], "after step 2's finish, step 3 reuses from 0")
    dist.barrier()
    return ok.report()


@pytest.mark.multiproc
def test_dist_transport_reuses_sent_frames_only_after_finish() -> None:
    sender, receiver = run_ranks(_send_frames_body, 2, timeout=90)
    assert sender == (3, []) and receiver == (8, [])


def _world_body() -> tuple[int, list[str]]:
    """Without groups both channels use the world group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tr = DistTransport([0, 1], rank, torch.device("cpu"), 30.0)
    ok = Checks()
    for i in range(2):
        if rank == 0:
            tr.send((torch.full((4,), float(i)),), 0, 1, "act", i)
        else:
            (got,) = tr.recv(0, 1, "act", i)
            ok.expect(torch.equal(got, torch.full((4,), float(i))), f"message {i}")
    tr.finish()
    dist.barrier()
    return ok.report()


@pytest.mark.multiproc
def test_dist_transport_defaults_to_the_world_group() -> None:
    _, report = run_ranks(_world_body, 2, timeout=90)
    assert report == (2, [])
