"""Moving values between pipeline stages: one interface, two transports.

A message is any pytree (tensors, tuples, dicts, ints, ``None``, HF ``ModelOutput``s) sent
from one stage to another on a *channel*: ``"act"`` (activations, forward), ``"grad"``
(gradients, backward) or ``"out"`` (the last stage's outputs, to every other pipeline rank).
Received tensors keep the sender's ``requires_grad`` flag but are new leaves: the autograd
graph is always cut at a stage boundary, so the executor's path is the same in-process and
across processes.

- ``InProcessTransport``: every stage lives in this process; a message is the value itself
  (detached, moved to the receiving stage's device) held in a mailbox.
- ``DistTransport``: torch.distributed point-to-point. A message is one *frame* (a byte
  buffer: an int64 flag, then every tensor of at most 256 KiB copied in at an aligned
  offset) followed by each larger tensor as its own message. The layout comes from the
  message's *header* (the pytree structure with shapes/dtypes), which both sides cache per
  (peer, channel): flag 0 means "same header as last time", the usual case, so a message
  of small tensors is a single point-to-point message and the receiver can post its
  receives before the sender sends. A changed header is announced by a frame (and fills
  for the large tensors) in the old layout carrying the new header's length, then, when
  the stream has another message this step, a second such fill flagged -1 (the receiver
  may have posted that message's receives in the old layout too), then the pickled
  header, then the message in the new layout. Both sides know how many messages each
  stream carries in a step (``prefetch`` and ``plan_sends``).
  ``prefetch`` keeps the next expected message's receives posted ahead of ``recv``, so
  data moves while the rank computes: under gloo a send whose receive is already posted
  is written straight to the socket, while one that comes first waits for a round trip
  through both ranks' gloo threads. A ``recv`` that is about to wait also posts the
  message after the awaited one (at most two are posted): posting costs tens of
  microseconds, spent better while waiting than in the rank's next turn, which in 1F1B is
  on the pipeline's critical path. Each channel has a process group (a connection) of its
  own (see ``DistTransport``). Under NCCL only the ``"out"`` channel is posted ahead: NCCL
  serialises a communicator's point-to-point operations, and a middle stage both receives
  and sends on the ``"act"`` and ``"grad"`` channels, so a receive posted early there
  would hold back its sends. gloo on CPU, NCCL on GPU (frames live on the transport's
  device). Every wait is bounded and raises ``SMPTimeoutError`` naming what it waited for.
"""

from __future__ import annotations

import ctypes
import functools
import math
import pickle
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from cost_model.errors import SMPInternalError, SMPRuntimeError, SMPTimeoutError
from smp_fx.runtime.buffers import BufferPool

CHANNELS = ("act", "grad", "out")
# Header leaves compared by == (with their types: 1 == 1.0 == True) instead of by pickles.
_PLAIN = frozenset((type(None), bool, int, float, str))
_ALIGN = 64  # frame offsets: any dtype can be viewed in place
_PACK_MAX = 256 * 1024  # bytes; a larger tensor is its own message (copying it costs more)
_NO_HEADER_FRAME = 8  # before any header: the frame is the flag alone
_SKIP = -1  # the flag of a fill that only stands in for an old-layout receive


class Transport(Protocol):
    """What the executor needs: ordered sends and receives between stages, and a hook
    called before a receive blocks (``on_block``)."""

    on_block: Any

    def send(self, value: Any, src: int, dst: int, channel: str, mb: int) -> None: ...

    def recv(self, src: int, dst: int, channel: str, mb: int) -> Any: ...

    def finish(self) -> None: ...

    def prefetch(self, src: int, dst: int, channel: str, count: int) -> None: ...

    def plan_sends(self, src: int, dst: int, channel: str, count: int) -> None: ...


def _cut(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    out = t.detach()
    if device is not None and out.device != device:
        out = out.to(device, non_blocking=True)
    return out.requires_grad_(t.requires_grad)


class InProcessTransport:
    """All stages in one process: messages are the values, cut from autograd."""

    def __init__(self, devices: dict[int, torch.device] | None = None) -> None:
        self.devices = devices or {}
        self._box: dict[tuple[int, int, str, int], Any] = {}
        self.on_block: Any = None  # never called: nothing here waits

    def send(self, value: Any, src: int, dst: int, channel: str, mb: int) -> None:
        device = self.devices.get(dst)
        self._box[(src, dst, channel, mb)] = pytree.tree_map_only(
            torch.Tensor, lambda t: _cut(t, device), value)

    def recv(self, src: int, dst: int, channel: str, mb: int) -> Any:
        key = (src, dst, channel, mb)
        if key not in self._box:
            raise SMPInternalError.build(
                "in-process receive has no matching send (the lowered order is wrong)",
                key, f"stage {dst} microbatch {mb}")
        return self._box.pop(key)

    def prefetch(self, src: int, dst: int, channel: str, count: int) -> None:
        """Nothing to post ahead in-process."""

    def plan_sends(self, src: int, dst: int, channel: str, count: int) -> None:
        """Messages are values in-process: nothing to plan."""

    def finish(self) -> None:
        if self._box:
            left = sorted(self._box)
            self._box.clear()
            raise SMPInternalError.build("messages were sent but never received", left[:4],
                                        "end of step")


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _shape_of(value: Any, leaves: list[torch.Tensor]) -> Any:
    """The usual message (tensors and None nested in tuples and lists) flattened by hand:
    its structure as a hashable value, its tensors appended to ``leaves``; None for anything
    else (``pytree`` then flattens it; it costs several microseconds per node)."""
    t = type(value)
    if t is torch.Tensor:
        leaves.append(value)
        return "T"
    if value is None:
        return "N"
    if t is tuple or t is list:
        inner = []
        for v in value:
            sub = _shape_of(v, leaves)
            if sub is None:
                return None
            inner.append(sub)
        return (t is list, tuple(inner))
    return None


def _header_leaves(leaves: list[Any]) -> list[Any]:
    """The leaves as a header lists them: tensors by their metadata."""
    return [_TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)
            if isinstance(t, torch.Tensor) else t for t in leaves]


def _build(shape: Any, leaves: Iterator[Any]) -> Any:
    """The inverse of ``_shape_of``."""
    if shape == "T":
        return next(leaves)
    if shape == "N":
        return None
    is_list, inner = shape
    values = [_build(sub, leaves) for sub in inner]
    return values if is_list else tuple(values)


@functools.lru_cache(maxsize=256)
def _spec_of(shape: Any) -> Any:
    """The pytree spec of a hand-flattened structure (tensors are leaves, like the 0s)."""
    return pytree.tree_flatten(_build(shape, iter(lambda: 0, None)))[1]


@dataclass(frozen=True)
class _Header:
    """A message's structure and where each tensor travels: ``offsets[i]`` is tensor i's
    byte offset in the frame, or None when it is a message of its own."""

    payload: bytes  # pickled (spec, leaves, shape): what goes over the wire
    spec: Any
    leaves: tuple[Any, ...]  # _TensorMeta or plain values
    shape: Any  # the hand-flattened structure (``_shape_of``), or None: use ``spec``
    key: Any  # a comparable form of (structure, leaves), None when a leaf is not plain
    metas: tuple[_TensorMeta, ...]
    offsets: tuple[int | None, ...]
    nbytes: tuple[int, ...]
    frame_size: int
    large: tuple[_TensorMeta, ...]  # the tensors that are messages of their own, in order

    @staticmethod
    def build(payload: bytes, spec: Any, leaves: list[Any], shape: Any, key: Any) -> _Header:
        metas = tuple(m for m in leaves if isinstance(m, _TensorMeta))
        offsets: list[int | None] = []
        end = _ALIGN
        for m in metas:
            if m.nbytes <= _PACK_MAX:
                offsets.append(end)
                end += -(-m.nbytes // _ALIGN) * _ALIGN
            else:
                offsets.append(None)
        large = tuple(m for m, off in zip(metas, offsets) if off is None)
        return _Header(payload, spec, tuple(leaves), shape, key, metas, tuple(offsets),
                       tuple(m.nbytes for m in metas), end, large)


def _frame_size(header: _Header | None) -> int:
    return header.frame_size if header is not None else _NO_HEADER_FRAME


def _large(header: _Header | None) -> tuple[_TensorMeta, ...]:
    return header.large if header is not None else ()


def _set_flag(frame: torch.Tensor, flag: int) -> None:
    if frame.device.type == "cpu":
        ctypes.c_int64.from_address(frame.data_ptr()).value = flag
    else:
        frame[:8].view(torch.int64).fill_(flag)


def _slot(frame: torch.Tensor, offset: int, nbytes: int, meta: _TensorMeta) -> torch.Tensor:
    """The frame bytes of one tensor, viewed as that tensor (no copy)."""
    if nbytes == 0:
        return torch.empty(meta.shape, dtype=meta.dtype, device=frame.device)
    return frame[offset:offset + nbytes].view(meta.dtype).view(meta.shape)


def _lost_step(flag: int, what: str, stage: int, mb: int) -> SMPRuntimeError:
    return SMPInternalError.build("the point-to-point protocol lost step", flag,
                                 f"{what}, stage {stage} microbatch {mb}")


@dataclass
class _SendFrame:
    """A reusable frame for one message of a stream, with its tensors' slots viewed out
    (None: a tensor sent on its own, or an empty one)."""

    header: _Header
    frame: torch.Tensor
    views: tuple[torch.Tensor | None, ...]


@dataclass
class _Posted:
    """The receives of one expected message, posted in the layout of ``header``, with the
    message's tensors already viewed out of their buffers (``views``, in header order, with
    the sender's ``requires_grad``): made while posting, which is mostly done while this
    rank waits, instead of after the message arrives, which is on the pipeline's critical
    path. ``addr``: the frame's address on CPU, where the flag is read directly."""

    header: _Header | None
    frame: torch.Tensor
    frame_work: Any
    large: list[tuple[Any, torch.Tensor, torch.Tensor]]  # (work, tensor, its buffer)
    views: tuple[torch.Tensor, ...] = ()
    addr: int = 0

    def flag(self) -> int:
        if self.addr:  # a direct read: slicing and viewing cost microseconds
            return ctypes.c_int64.from_address(self.addr).value
        return int(self.frame[:8].view(torch.int64).item())


class DistTransport:
    """torch.distributed point-to-point between the ranks holding each stage.

    ``ranks[s]`` is the global rank holding stage ``s`` of this rank's pipeline.
    ``groups`` maps a channel to its process group; a channel it does not name uses the
    world group. The runtime passes ``DistTransport.make_groups()`` (created collectively on
    every rank): a group, and so a connection, per channel. Under NCCL this keeps the
    ``"out"`` messages from interleaving with gradients between the same two ranks (NCCL
    matches point-to-point messages by order, per communicator). Under gloo it keeps a
    rank's sends off the connection its incoming messages arrive on: gloo locks a
    connection while its thread reads a message in, and a send that needs the same lock
    waits, sometimes for milliseconds when that thread is descheduled on a busy machine
    (measured on the pipeline benchmark: a send stalled over 0.5 ms in one step of five on
    each rank with one connection for both directions; with a group per channel the
    stalls fell to about one step in twenty, and 1F1B steps got 2-3 % faster).
    """

    def __init__(self, ranks: list[int], stage: int, device: torch.device,
                 timeout_s: float, groups: Mapping[str, Any] | None = None) -> None:
        self.ranks = ranks
        self.stage = stage
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.groups: dict[str, Any] = dict(groups or {})
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._buffers = BufferPool(device)
        self._p2p_cache: dict[tuple[int, int], tuple[Any, int]] = {}
        # Per (peer stage, channel): the frames of a step's messages, reused step after
        # step (``_send_frame``), and how many this step has used.
        self._send_frames: dict[tuple[int, str], list[_SendFrame]] = {}
        self._send_count: dict[tuple[int, str], int] = {}
        # The last header sent to / received from each (peer stage, channel).
        self._sent: dict[tuple[int, str], _Header] = {}
        self._got: dict[tuple[int, str], _Header] = {}
        # Per (peer stage, channel): receives posted ahead (at most two, oldest first), how
        # many more messages this step expects and has not posted, whether it may post
        # ahead (the backend), and how many messages this step still sends.
        self._posted: dict[tuple[int, str], deque[_Posted]] = {}
        self._left: dict[tuple[int, str], int] = {}
        self._ahead: dict[tuple[int, str], bool] = {}
        self._to_send: dict[tuple[int, str], int] = {}
        # Called before this rank blocks on a message that has not arrived (the executor
        # wakes the step functions it held back: they run while this rank waits).
        self.on_block: Any = None

    @staticmethod
    def make_groups(backend: str | None = None) -> dict[str, Any]:
        """A process group per channel; collective: call on every rank in the same order."""
        ranks = list(range(dist.get_world_size()))
        return {channel: dist.new_group(ranks, backend=backend) for channel in CHANNELS}

    def _group(self, channel: str) -> Any:
        return self.groups.get(channel)

    def _p2p(self, peer: int, group: Any) -> tuple[Any, int]:
        """The process group object and ``peer``'s rank in it. Point-to-point calls go to
        it directly: ``dist.isend``/``irecv`` re-resolve both on every call, a sizeable part
        of a small message's cost on the pipeline's busiest rank."""
        key = (peer, id(group))
        hit = self._p2p_cache.get(key)
        if hit is None:
            pg = group if group is not None else dist.group.WORLD
            hit = self._p2p_cache[key] = (pg, dist.get_group_rank(pg, peer))
        return hit

    def _irecv(self, t: torch.Tensor, peer: int, group: Any) -> Any:
        pg, group_rank = self._p2p(peer, group)
        return pg.recv([torch.view_as_real(t) if t.is_complex() else t], group_rank, 0)

    # ---- sending ------------------------------------------------------------------------
    def _isend(self, t: torch.Tensor, peer: int, group: Any) -> None:
        pg, group_rank = self._p2p(peer, group)
        wire = torch.view_as_real(t) if t.is_complex() else t
        self._pending.append((pg.send([wire], group_rank, 0), t))

    def _send_fill(self, old: _Header | None, flag: int, peer: int, group: Any) -> None:
        """A message in ``old``'s layout that carries only ``flag``, a new header's length
        (the receiver posted receives shaped by ``old``)."""
        frame = torch.zeros(_frame_size(old), dtype=torch.uint8, device=self.device)
        _set_flag(frame, flag)
        self._isend(frame, peer, group)
        for m in _large(old):
            self._isend(torch.zeros(m.shape, dtype=m.dtype, device=self.device), peer, group)

    def plan_sends(self, src: int, dst: int, channel: str, count: int) -> None:
        """This step sends ``count`` messages to ``dst`` on ``channel`` (see ``send``)."""
        self._to_send[(dst, channel)] = count

    def send(self, value: Any, src: int, dst: int, channel: str, mb: int) -> None:
        """Send one message. A header change while the stream has another message this
        step (``plan_sends``) is followed by a skip fill for that message's receives, which
        the receiver may have posted in the old layout."""
        peer, group = self.ranks[dst], self._group(channel)
        old = self._sent.get((dst, channel))
        to_send = self._to_send.get((dst, channel), 0)
        if to_send:
            self._to_send[(dst, channel)] = to_send - 1
        leaves: list[Any] = []
        shape = _shape_of(value, leaves)
        if shape is None:
            leaves, spec = pytree.tree_flatten(value)
        tensors = [t.detach() for t in leaves if isinstance(t, torch.Tensor)]
        # The usual message repeats the last one's header: recognise it without pickling
        # when every non-tensor leaf is a plain value (whose == is exact and cheap).
        header_leaves: list[Any] = []
        if shape is not None:  # every leaf is a tensor
            key: Any = (shape, tuple((t.shape, t.dtype, t.requires_grad) for t in leaves))
        else:
            header_leaves = _header_leaves(leaves)
            if all(isinstance(x, _TensorMeta) or type(x) in _PLAIN for x in header_leaves):
                key = (spec, [x if isinstance(x, _TensorMeta) else (type(x), x)
                              for x in header_leaves])
            else:
                key = None
        same = old is not None and key is not None and old.key == key
        if not same:
            if shape is not None:
                header_leaves, spec = _header_leaves(leaves), _spec_of(shape)
            payload = pickle.dumps((spec, header_leaves, shape))
            if old is None or old.payload != payload:
                self._send_fill(old, len(payload), peer, group)
                if to_send > 1:
                    self._send_fill(old, _SKIP, peer, group)
                self._isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                            .to(self.device), peer, group)
                old = _Header.build(payload, spec, header_leaves, shape, key)
                self._sent[(dst, channel)] = old
        out = self._send_frame((dst, channel), old)
        large = []
        for t, off, view in zip(tensors, old.offsets, out.views):
            if off is None:
                large.append(t.contiguous())
            elif view is not None:
                view.copy_(t)
        self._isend(out.frame, peer, group)
        for t in large:
            self._isend(t, peer, group)

    def _send_frame(self, key: tuple[int, str], header: _Header) -> _SendFrame:
        """The frame for this step's next message on stream ``key``: the k-th message of a
        step reuses the frame (and slot views) of the k-th message of the last step, whose
        send ``finish`` saw complete. After a step that did not finish (it failed), the
        count goes on instead, so a frame a send may still read is never written. On an
        accelerator every frame is new, as the ``BufferPool`` does there (the host does not
        see when the device is done with one)."""
        i = self._send_count.get(key, 0)
        self._send_count[key] = i + 1
        ring = self._send_frames.setdefault(key, [])
        if i < len(ring) and ring[i].header is header and self.device.type == "cpu":
            return ring[i]
        frame = torch.empty(header.frame_size, dtype=torch.uint8, device=self.device)
        _set_flag(frame, 0)
        out = _SendFrame(header, frame, tuple(
            None if off is None or not n else _slot(frame, off, n, m)
            for m, off, n in zip(header.metas, header.offsets, header.nbytes)))
        if i < len(ring):
            ring[i] = out
        else:
            ring.append(out)
        return out

    # ---- receiving ----------------------------------------------------------------------
    def _post(self, src: int, channel: str) -> _Posted:
        """Post the receives of the next message from ``src``, shaped by the known header."""
        peer, group = self.ranks[src], self._group(channel)
        header = self._got.get((src, channel))
        frame = self._buffers.take(_frame_size(header))
        work = self._irecv(frame, peer, group)
        large = []
        for m in _large(header):
            buf = self._buffers.take(m.nbytes)
            t = _slot(buf, 0, m.nbytes, m)
            large.append((self._irecv(t, peer, group), t, buf))
        views: tuple[torch.Tensor, ...] = ()
        if header is not None:
            big = iter(t for _, t, _ in large)
            views = tuple((next(big) if off is None else _slot(frame, off, n, m))
                          .requires_grad_(m.requires_grad)
                          for m, off, n in zip(header.metas, header.offsets, header.nbytes))
        addr = frame.data_ptr() if frame.device.type == "cpu" else 0
        return _Posted(header, frame, work, large, views, addr)

    def prefetch(self, src: int, dst: int, channel: str, count: int) -> None:
        """Expect ``count`` messages from ``src`` on ``channel`` this step, and keep the next
        one's receives posted ahead of ``recv`` (where the backend allows, see the module
        doc). Each channel has its own group, a rank receives at most one channel per peer
        and group (activations from earlier stages, gradients from later ones, outputs),
        and gloo matches a peer's messages by order, so receives posted ahead always meet
        their message."""
        key = (src, channel)
        if count <= 0 or self._posted.get(key):
            return
        self._left[key] = count
        self._ahead[key] = channel == "out" or dist.get_backend(self._group(channel)) == "gloo"
        if self._ahead[key]:
            self._posted[key] = deque([self._post_next(key)])

    def _post_next(self, key: tuple[int, str]) -> _Posted:
        """Post the stream's next expected message (one fewer left to post)."""
        left = self._left.get(key, 0)
        if left:
            self._left[key] = left - 1
        return self._post(*key)

    def recv(self, src: int, dst: int, channel: str, mb: int) -> Any:
        """Receive one message; post the next one ahead while waiting (see the module doc)."""
        key = (src, channel)
        queue = self._posted.setdefault(key, deque())
        posted = queue.popleft() if queue else self._post_next(key)
        ahead = self._ahead.get(key, False) and self._left.get(key, 0) > 0
        if ahead and not queue and not posted.frame_work.is_completed():
            queue.append(self._post_next(key))
        value = self._recv(posted, queue, src, dst, channel, mb)
        if ahead and not queue and self._left[key] > 0:
            queue.append(self._post_next(key))
        return value

    def _recv(self, posted: _Posted, queue: deque[_Posted], src: int, dst: int,
              channel: str, mb: int) -> Any:
        what = f"{channel} from stage {src} (rank {self.ranks[src]})"
        key = (src, channel)
        self._wait_all(posted, what, dst, mb)
        flag = posted.flag()
        if flag > 0:  # a new header, then the message in its layout
            if queue or self._left.get(key, 0):  # the next message's skip fill
                if queue:
                    skip = queue.popleft()
                    self._left[key] += 1  # posted for a message still to come
                else:
                    skip = self._post(src, channel)
                self._wait_all(skip, what, dst, mb)
                if skip.flag() != _SKIP:
                    raise _lost_step(skip.flag(), what, dst, mb)
                self._give_back(skip)
            data = torch.empty(flag, dtype=torch.uint8, device=self.device)
            self._wait(self._irecv(data, self.ranks[src], self._group(channel)), what,
                       dst, mb)
            payload = data.cpu().numpy().tobytes()
            with warnings.catch_warnings():  # unpickling a LeafSpec warns in torch 2.13
                warnings.simplefilter("ignore", FutureWarning)
                spec, leaves, shape = pickle.loads(payload)
            self._got[key] = _Header.build(payload, spec, leaves, shape, None)
            self._give_back(posted)
            posted = self._post(src, channel)
            self._wait_all(posted, what, dst, mb)
            flag = posted.flag()
        if flag != 0 or posted.header is None:
            raise _lost_step(flag, what, dst, mb)
        value = self._unpack(posted)
        self._give_back(posted)  # reused once the tensors viewing it are gone
        return value

    def _give_back(self, posted: _Posted) -> None:
        self._buffers.give(posted.frame)
        for _, _, buf in posted.large:
            self._buffers.give(buf)

    @staticmethod
    def _unpack(posted: _Posted) -> Any:
        header = posted.header
        assert header is not None
        tensors = iter(posted.views)
        if header.shape is not None:
            return _build(header.shape, tensors)
        values = [next(tensors) if isinstance(leaf, _TensorMeta) else leaf
                  for leaf in header.leaves]
        return pytree.tree_unflatten(values, header.spec)

    def _wait_all(self, posted: _Posted, what: str, stage: int, mb: int) -> None:
        self._wait(posted.frame_work, what, stage, mb)
        for work, _, _ in posted.large:
            self._wait(work, what, stage, mb)

    def _wait(self, work: Any, what: str, stage: int, mb: int) -> None:
        if self.on_block is not None and not work.is_completed():
            self.on_block()
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise SMPTimeoutError.build(
                f"timed out after {self.timeout.total_seconds():.0f}s waiting for {what}",
                str(exc).splitlines()[0] if str(exc) else None,
                f"rank {dist.get_rank()} stage {stage} microbatch {mb}",
                "check that every rank runs the same smp.step calls; a peer may have "
                "failed (see its log)") from exc

    def finish(self) -> None:
        """Wait for this step's sends (their buffers stay alive until then)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._wait(work, "a send to complete", self.stage, -1)
        self._send_count.clear()  # not after a failed wait: a send may still read a frame
        posted = sorted(k for k, q in self._posted.items() if q)
        unsent = sorted(k for k, n in self._to_send.items() if n)
        self._posted.clear()
        self._left.clear()
        self._to_send.clear()
        if posted or unsent:
            raise SMPInternalError.build(
                "receives were posted ahead for messages that never came" if posted else
                "fewer messages were sent than planned", posted or unsent,
                f"rank {dist.get_rank()} end of step")
