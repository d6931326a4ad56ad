"""The torch.distributed transport: point-to-point between the ranks holding the stages.

Receives are posted ahead while the rank waits, so data moves while it computes (under
NCCL, which serialises a communicator's point-to-point ops, only the ``out`` channel).
Every wait is bounded. See docs/runtime.md ('DistTransport') and docs/performance.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cost_model.errors import SMPError, SMPInternalError
from smp_fx.runtime.executor.failures import wait_failed
from smp_fx.runtime.executor.lowering import CHANNELS, stage_name
from smp_fx.runtime.transport import wire
from smp_fx.runtime.transport.buffers import BufferPool
from smp_fx.world import order_mode, state

_Key = tuple[int, int, str]  # (sending stage, receiving stage, channel): one stream


@dataclass
class _SendFrame:
    """A reusable frame for one message of a stream, with its tensors' slots viewed out
    (None: a tensor sent on its own, or an empty one)."""

    header: wire.Header
    frame: torch.Tensor
    views: tuple[torch.Tensor | None, ...]


@dataclass
class _Posted:
    """The receives of one expected message, posted in ``header``'s layout with the tensor
    views made while posting (off the critical path)."""

    header: wire.Header | None
    frame: torch.Tensor
    frame_work: Any
    large: list[tuple[Any, torch.Tensor, torch.Tensor]]  # (work, tensor, its buffer)
    views: tuple[torch.Tensor, ...] = ()
    addr: int = 0

    def flag(self) -> int:
        if self.addr:
            return wire.flag_at(self.addr)
        return wire.read_flag(self.frame.view(torch.uint8), wire.flag_offset(self.header))


def _lost_step(flag: int, what: str, stage: int, mb: int) -> SMPError:
    return SMPInternalError.build("the point-to-point protocol lost step", flag,
                                  f"{what}, stage {stage} microbatch {mb}")


class DistTransport:
    """torch.distributed point-to-point between the ranks holding each stage.

    A process group (a connection) per channel and pair of lanes: NCCL matches messages
    by order per communicator, and gloo locks a connection while reading, so a rank's
    sends stay off its incoming connection (1F1B 2-3 % faster; docs/performance.md)."""

    def __init__(self, ranks: list[int], stage: int, device: torch.device,
                 timeout_s: float, groups: Mapping[tuple[str, int, int], Any] | None = None,
                 lanes: tuple[int, ...] | None = None) -> None:
        self.ranks = ranks
        self.stage = stage
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.groups: dict[tuple[str, int, int], Any] = dict(groups or {})
        self.lanes = lanes if lanes is not None else (0,) * len(ranks)
        self._pending: list[tuple[Any, torch.Tensor, int]] = []  # (work, tensor, peer stage)
        self._buffers = BufferPool(device)
        self._p2p_cache: dict[tuple[int, int], tuple[Any, int]] = {}
        # Per stream: the frames of a step's messages, reused step after step
        # (``_reused_send_frame``), and how many this step has used.
        self._send_frames: dict[_Key, list[_SendFrame]] = {}
        self._send_count: dict[_Key, int] = {}
        # The last header sent to / received from each stream.
        self._sent: dict[_Key, wire.Header] = {}
        self._got: dict[_Key, wire.Header] = {}
        # Per stream: receives posted ahead (oldest first), how many more messages this
        # step expects and has not posted, whether it posts ahead (the backend), and how
        # many messages this step still sends.
        self._posted: dict[_Key, deque[_Posted]] = {}
        self._left: dict[_Key, int] = {}
        self._ahead: dict[_Key, bool] = {}
        self._to_send: dict[_Key, int] = {}
        # Called before this rank blocks on a message that has not arrived (the executor
        # wakes the step functions it held back: they run while this rank waits).
        self.on_block: Any = None
        # Where this rank is in its work, for error messages (the executor's flight record).
        self.where: Callable[[], str] | None = None

    @staticmethod
    def make_groups(backend: str | None = None, lanes: int = 1
                    ) -> dict[tuple[str, int, int], Any]:
        """A process group per channel and (sending, receiving) lane; collective, in one order on
        every rank. Two streams between two ranks never share a group, so each keeps its
        own order; the models of a process share them (``state.shared_group``), new ones
        after a step failed on any rank (``state.renew_spoilt_shared``)."""
        state.renew_spoilt_shared()
        ranks = list(range(dist.get_world_size()))
        return {(channel, src, dst): state.shared_group(("pipeline", channel, src, dst), ranks,
                                                        backend)
                for src in range(lanes) for dst in range(lanes) for channel in CHANNELS}

    def _group(self, key: _Key) -> Any:
        """The group of stream ``key`` (its pair of lanes')."""
        src, dst, channel = key
        return self.groups.get((channel, self.lanes[src], self.lanes[dst]))

    def _p2p(self, peer: int, group: Any) -> tuple[Any, int]:
        """The process group object and ``peer``'s rank in it, resolved once: ``dist.isend``
        re-resolves both per call, a sizeable part of a small message's cost."""
        key = (peer, id(group))
        hit = self._p2p_cache.get(key)
        if hit is None:
            pg: Any = group if group is not None else dist.group.WORLD
            hit = self._p2p_cache[key] = (pg, dist.get_group_rank(pg, peer))
        return hit

    def _irecv(self, t: torch.Tensor, peer: int, group: Any) -> Any:
        pg, group_rank = self._p2p(peer, group)
        return pg.recv([torch.view_as_real(t) if t.is_complex() else t], group_rank, 0)

    # ---- sending ------------------------------------------------------------------------
    def _isend(self, t: torch.Tensor, peer: int, group: Any, stage: int) -> None:
        pg, group_rank = self._p2p(peer, group)
        wired = torch.view_as_real(t) if t.is_complex() else t
        self._pending.append((pg.send([wired], group_rank, 0), t, stage))

    def _failed(self, exc: BaseException, peer_stage: int, receiving: bool) -> SMPError:
        """The error for a transfer with ``peer_stage`` that raised ``exc`` in the backend."""
        where = self.where() if self.where is not None else (
            f"rank {dist.get_rank()} ({stage_name(self.stage)})")
        return wait_failed(exc, stage_name(peer_stage, self.ranks), self.ranks[peer_stage],
                           receiving, self.timeout.total_seconds(), where)

    def _send_fill(self, old: wire.Header | None, flag: int, peer: int, group: Any,
                   stage: int) -> None:
        """A message in ``old``'s layout that carries only ``flag``, a new header's length
        (the receiver posted receives shaped by ``old``)."""
        frame = torch.zeros(wire.frame_size(old), dtype=torch.uint8, device=self.device)
        wire.write_flag(frame, flag, wire.flag_offset(old))
        self._isend(frame, peer, group, stage)
        for m in wire.large(old):
            self._isend(torch.zeros(m.shape, dtype=m.dtype, device=self.device), peer, group,
                        stage)

    def _direct(self, key: _Key) -> bool:
        """Whether this rank sends a stream's one-tensor messages as the tensors themselves
        (``wire.direct_layout``): gloo takes a short message into a longer receive, NCCL
        does not, and neither does its rule as ``SMP_FX_CHECK_ORDER`` checks it."""
        return (self.device.type == "cpu" and not order_mode.enabled()
                and dist.get_backend(self._group(key)) == "gloo")

    def _posts_ahead(self, channel: str) -> bool:
        """Whether a stream on ``channel`` posts its receives ahead; both sides decide alike, so a
        header change's fills are counted right."""
        group = self._group((self.stage, self.stage, channel))
        return channel == "out" or dist.get_backend(group) == "gloo"

    def _skips(self, channel: str, later: int) -> int:
        """Skip fills after a header change: one per receive the peer may have posted in the old
        layout for the ``later`` messages."""
        return later if self._posts_ahead(channel) else min(later, 1)

    def plan_sends(self, src: int, dst: int, channel: str, count: int) -> None:
        """This step sends ``count`` messages to ``dst`` on ``channel`` (see ``send``)."""
        self._to_send[(src, dst, channel)] = count

    def send(self, value: Any, src: int, dst: int, channel: str, mb: int) -> None:
        """Send one message, followed by a skip fill when its header changed and the stream has
        another message this step."""
        try:
            self._send(value, src, dst, channel)
        except SMPError:
            raise
        except RuntimeError as exc:  # posting on a connection the peer closed
            raise self._failed(exc, dst, receiving=False) from exc

    def _send(self, value: Any, src: int, dst: int, channel: str) -> None:
        key = (src, dst, channel)
        peer, group = self.ranks[dst], self._group(key)
        old = self._sent.get(key)
        to_send = self._to_send.get(key, 0)
        if to_send:
            self._to_send[key] = to_send - 1
        flat = wire.flatten(value)
        if old is None or flat.key is None or old.key != flat.key:
            direct = self._direct(key)
            payload, spec, leaves = wire.payload_of(flat, direct)
            if old is None or old.payload != payload:
                self._send_fill(old, len(payload), peer, group, dst)
                for _ in range(self._skips(channel, to_send - 1)):
                    self._send_fill(old, wire.SKIP, peer, group, dst)
                self._isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                            .to(self.device), peer, group, dst)
                old = self._sent[key] = wire.header(payload, spec, leaves, flat.shape,
                                                    flat.key, direct)
        if old.direct:
            self._send_direct(flat.tensors[0], peer, group, dst)
            return
        out = self._reused_send_frame(key, old)
        large = wire.pack(old, out.views, flat.tensors)
        self._isend(out.frame, peer, group, dst)
        for t in large:
            self._isend(t, peer, group, dst)

    def _send_direct(self, t: torch.Tensor, peer: int, group: Any, stage: int) -> None:
        """A one-tensor message sent as the tensor itself, no frame (``wire.direct_layout``);
        like torch's pipelining, it relies on nothing changing a sent tensor (a stage's
        output or input gradient) in place before ``finish``."""
        self._isend(t if t.is_contiguous() else t.contiguous(), peer, group, stage)

    def _reused_send_frame(self, key: _Key, header: wire.Header) -> _SendFrame:
        """The frame for stream ``key``'s next message, reusing last step's k-th frame (13-37 us
        a message, docs/performance.md); safe because ``finish`` saw those sends complete.
        On an accelerator every frame is new."""
        i = self._send_count.get(key, 0)
        self._send_count[key] = i + 1
        ring = self._send_frames.setdefault(key, [])
        if i < len(ring) and ring[i].header is header and self.device.type == "cpu":
            return ring[i]
        frame = torch.empty(header.frame_size, dtype=torch.uint8, device=self.device)
        wire.write_flag(frame, 0)
        out = _SendFrame(header, frame, wire.send_slots(frame, header))
        if i < len(ring):
            ring[i] = out
        else:
            ring.append(out)
        return out

    # ---- receiving ----------------------------------------------------------------------
    def _post(self, key: _Key) -> _Posted:
        """Post the receives of stream ``key``'s next message, shaped by the known header."""
        peer, group = self.ranks[key[0]], self._group(key)
        header = self._got.get(key)
        if header is not None and header.direct:
            return self._post_direct(header, peer, group)
        frame = self._buffers.take(wire.frame_size(header))
        work = self._irecv(frame, peer, group)
        large = []
        for m in wire.large(header):
            buf = self._buffers.take(m.nbytes)
            t = wire.slot(buf, 0, m.nbytes, m)
            large.append((self._irecv(t, peer, group), t, buf))
        views: tuple[torch.Tensor, ...] = ()
        if header is not None:
            views = wire.received_views(frame, header, [t for _, t, _ in large])
        addr = frame.data_ptr() if frame.device.type == "cpu" else 0
        return _Posted(header, frame, work, large, views, addr)

    def _post_direct(self, header: wire.Header, peer: int, group: Any) -> _Posted:
        """Post a direct frame (``wire.direct_layout``) of the tensor's dtype, its flag zeroed
        first (a tensor's message leaves it untouched), its tensor one ``as_strided`` of it."""
        frame = self._buffers.take(header.frame_size, header.metas[0].dtype)
        addr = frame.data_ptr() + header.flag_offset
        wire.write_flag(frame, 0, header.flag_offset)
        work = self._irecv(frame, peer, group)
        return _Posted(header, frame, work, [], (wire.direct_view(frame, header),), addr)

    def prefetch(self, src: int, dst: int, channel: str, count: int) -> None:
        """Expect ``count`` messages on a stream this step and post the first one's receives where
        the backend allows; a group per stream means they always meet their message."""
        key = (src, dst, channel)
        if count <= 0 or self._posted.get(key):
            return
        self._left[key] = count
        self._ahead[key] = self._posts_ahead(channel)
        if self._ahead[key]:
            try:
                self._posted[key] = deque([self._post_next(key)])
            except RuntimeError as exc:  # the peer closed the connection already
                raise self._failed(exc, src, receiving=True) from exc

    def _post_all(self, key: _Key) -> deque[_Posted]:
        """Post every message the stream still expects this step: a burst of sends is written
        straight to the socket only if its receives are posted, else it is throttled to
        the receiver's pace. Costs a buffer per message (docs/performance.md)."""
        queue: deque[_Posted] = deque()
        while self._left.get(key, 0):
            queue.append(self._post_next(key))
        return queue

    def _post_next(self, key: _Key) -> _Posted:
        """Post the stream's next expected message (one fewer left to post)."""
        left = self._left.get(key, 0)
        if left:
            self._left[key] = left - 1
        return self._post(key)

    def recv(self, src: int, dst: int, channel: str, mb: int) -> Any:
        """Receive one message; where the stream posts ahead (see the module doc), post the
        rest of the step's while waiting for it, else keep the next one posted."""
        key = (src, dst, channel)
        try:
            queue = self._posted.setdefault(key, deque())
            posted = queue.popleft() if queue else self._post_next(key)
            ahead = self._ahead.get(key, False)
            if ahead and not posted.frame_work.is_completed():  # about to wait: post the rest
                queue.extend(self._post_all(key))
            value = self._recv(posted, queue, src, dst, channel, mb)
            if ahead and not queue and self._left.get(key, 0):  # keep the next one posted
                queue.append(self._post_next(key))
        except SMPError:
            raise
        except RuntimeError as exc:  # a lost connection or a timeout, in the backend's words
            raise self._failed(exc, src, receiving=True) from exc
        return value

    def _recv(self, posted: _Posted, queue: deque[_Posted], src: int, dst: int,
              channel: str, mb: int) -> Any:
        key = (src, dst, channel)
        self._wait_all(posted)
        flag = posted.flag()
        if flag > 0:  # a new header, then the message in its layout
            for _ in range(self._skips(channel, len(queue) + self._left.get(key, 0))):
                if queue:  # posted in the old layout for a message still to come
                    skip = queue.popleft()
                    self._left[key] += 1
                else:
                    skip = self._post(key)
                self._wait_all(skip)
                if skip.flag() != wire.SKIP:
                    raise _lost_step(skip.flag(), f"{channel} from {stage_name(src, self.ranks)}",
                                     dst, mb)
                self._give_back(skip)
            data = torch.empty(flag, dtype=torch.uint8, device=self.device)
            self._wait(self._irecv(data, self.ranks[src], self._group(key)))
            self._got[key] = wire.decode(data.cpu().numpy().tobytes())
            self._give_back(posted)
            posted = self._post(key)
            self._wait_all(posted)
            flag = posted.flag()
        if flag != 0 or posted.header is None:
            raise _lost_step(flag, f"{channel} from {stage_name(src, self.ranks)}", dst, mb)
        value = wire.unpack(posted.header, posted.views)
        self._give_back(posted)  # reused once the tensors viewing it are gone
        return value

    def _give_back(self, posted: _Posted) -> None:
        self._buffers.give(posted.frame)
        for _, _, buf in posted.large:
            self._buffers.give(buf)

    def _wait_all(self, posted: _Posted) -> None:
        self._wait(posted.frame_work)
        for work, _, _ in posted.large:
            self._wait(work)

    def _wait(self, work: Any) -> None:
        """Bounded wait; the backend's error (a lost peer, a timeout) reaches the public
        method, which knows the peer and says what it means (``_failed``)."""
        if self.on_block is not None and not work.is_completed():
            self.on_block()
        work.wait(self.timeout)

    def abandon(self, reason: str) -> None:
        """The step failed: its receives posted ahead and its unmet sends stay on the shared
        groups (and gloo closes a group's connection on a timeout), so the groups serve no
        later model (``state.spoil_shared``). The posted receives stay referenced here: the
        backend may still write into their buffers."""
        state.spoil_shared(reason)

    def finish(self) -> None:
        """Wait for this step's sends (their buffers stay alive until then)."""
        pending, self._pending = self._pending, []
        for work, _, stage in pending:
            try:
                self._wait(work)
            except RuntimeError as exc:
                raise self._failed(exc, stage, receiving=False) from exc
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
