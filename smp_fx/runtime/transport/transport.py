"""Moving values between pipeline stages: the interface, and the in-process transport.

Received tensors are new leaves with the sender's ``requires_grad``: autograd is cut at
every stage boundary, so the executor's path is the same in-process and across processes.
See docs/runtime.md, 'The transport contract'. In-process copies between two accelerators
run on transfer streams (``transfer_stream.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.utils._pytree as pytree

from cost_model.errors import SMPInternalError
from smp_fx.runtime.transport import transfer_stream as ts

if TYPE_CHECKING:
    from smp_fx.runtime.transport.transfer_stream import Pending


class Transport(Protocol):
    """What the executor needs: ordered sends and receives between stages, the per-step
    message counts of each stream (so receives can be posted ahead), the end of a step, a
    hook called before a receive blocks (``on_block``), and one that says where this rank is
    in its work, for the errors of a failed transfer (``where``, the executor's)."""

    on_block: Any
    where: Any

    def send(self, value: Any, src: int, dst: int, channel: str, mb: int) -> None:
        """Send ``value`` from stage ``src`` to stage ``dst`` (in schedule order)."""

    def recv(self, src: int, dst: int, channel: str, mb: int) -> Any:
        """The next message from ``src`` to ``dst`` on ``channel``."""

    def prefetch(self, src: int, dst: int, channel: str, count: int) -> None:
        """This step receives ``count`` messages on the stream: receives may be posted
        ahead (``lowering.receive_posts`` says when to call this)."""

    def plan_sends(self, src: int, dst: int, channel: str, count: int) -> None:
        """This step sends ``count`` messages on the stream (``lowering.send_counts``)."""

    def finish(self) -> None:
        """The step is over: wait for its sends; raise if a message went astray."""

    def abandon(self, reason: str) -> None:
        """The step failed: nothing it left in flight may meet a later step's message."""


def _cut(t: torch.Tensor, device: torch.device | None, streams: ts.TransferStreams,
         pending: Pending) -> torch.Tensor:
    out = t.detach()
    if device is not None and out.device != device:
        if streams.usable(out.device, device):
            out, done = ts.copy_on_transfer_streams(out, device, streams)
            pending.append((out, done))
        else:
            out = out.to(device, non_blocking=True)
    return out.requires_grad_(t.requires_grad)


class InProcessTransport:
    """All stages in one process: messages are the values, cut from autograd (copied where
    the receiver's device differs)."""

    def __init__(self, devices: dict[int, torch.device] | None = None) -> None:
        self.devices = devices or {}
        self.streams = ts.TransferStreams()
        self._box: dict[tuple[int, int, str, int], tuple[Any, Pending]] = {}
        self.on_block: Any = None  # never called: nothing here waits
        self.where: Any = None  # never called: nothing here fails on a peer

    def send(self, value: Any, src: int, dst: int, channel: str, mb: int) -> None:
        device = self.devices.get(dst)
        pending: Pending = []
        self._box[(src, dst, channel, mb)] = (pytree.tree_map_only(
            torch.Tensor, lambda t: _cut(t, device, self.streams, pending), value), pending)

    def recv(self, src: int, dst: int, channel: str, mb: int) -> Any:
        key = (src, dst, channel, mb)
        if key not in self._box:
            raise SMPInternalError.build(
                "in-process receive has no matching send (the lowered order is wrong)",
                key, f"stage {dst} microbatch {mb}")
        value, pending = self._box.pop(key)
        if pending:
            ts.consume(pending, self.devices[dst])
        return value

    def prefetch(self, src: int, dst: int, channel: str, count: int) -> None:
        """Nothing to post ahead in-process."""

    def plan_sends(self, src: int, dst: int, channel: str, count: int) -> None:
        """Messages are values in-process: nothing to plan."""

    def abandon(self, reason: str) -> None:
        """The failed step's messages go: the next step sends its own."""
        self._box.clear()

    def finish(self) -> None:
        if self._box:
            left = sorted(self._box)
            self._box.clear()
            raise SMPInternalError.build("messages were sent but never received", left[:4],
                                         "end of step")
