"""Moving values between pipeline stages: one interface, two transports.

A message is any pytree (tensors, tuples, dicts, ints, ``None``, HF ``ModelOutput``s) sent
from one stage to another on a *channel*: ``"act"`` (activations, forward), ``"grad"``
(gradients, backward) or ``"out"`` (the last stage's outputs, to every other pipeline rank).
Received tensors keep the sender's ``requires_grad`` flag but are new leaves: the autograd
graph is always cut at a stage boundary, so the executor's path is the same in-process and
across processes.

- ``InProcessTransport``: every stage lives in this process; a message is the value itself
  (detached, moved to the receiving stage's device) held in a mailbox.
- ``DistTransport``: torch.distributed point-to-point. A small header (the pickled tree
  structure with shapes/dtypes, or 0 for "same as last time") goes first, then each tensor
  with ``isend``/``irecv``. A receiver that knows the last header posts the flag's and the
  tensors' receives together (one round trip); a sender whose header changed first fills
  those pre-posted receives with zeros, so the protocol stays in step. gloo
  on CPU, NCCL on GPU (header tensors live on the transport's device). The ``"out"`` channel
  uses its own process group so that its messages never interleave with gradients between
  the same two ranks: NCCL matches point-to-point messages by order, per communicator.
  ``prefetch`` keeps the next expected message's receives posted ahead of ``recv`` (the
  ``"out"`` channel always; activations under gloo), so data moves while the rank computes.
  Every wait is bounded and raises ``SMPTimeoutError`` naming what it waited for.
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from cost_model.errors import SMPRuntimeError, SMPTimeoutError

CHANNELS = ("act", "grad", "out")
# Header leaves compared by == (with their types: 1 == 1.0 == True) instead of by pickles.
_PLAIN = frozenset((type(None), bool, int, float, str))


class Transport(Protocol):
    """What the executor needs: ordered sends and receives between stages."""

    def send(self, value: Any, src: int, dst: int, channel: str, mb: int) -> None: ...

    def recv(self, src: int, dst: int, channel: str, mb: int) -> Any: ...

    def finish(self) -> None: ...

    def prefetch(self, src: int, dst: int, channel: str, count: int) -> None: ...


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

    def send(self, value: Any, src: int, dst: int, channel: str, mb: int) -> None:
        device = self.devices.get(dst)
        self._box[(src, dst, channel, mb)] = pytree.tree_map_only(
            torch.Tensor, lambda t: _cut(t, device), value)

    def recv(self, src: int, dst: int, channel: str, mb: int) -> Any:
        key = (src, dst, channel, mb)
        if key not in self._box:
            raise SMPRuntimeError.build(
                "in-process receive has no matching send (the lowered order is wrong)",
                key, f"stage {dst} microbatch {mb}", "report this as an smp-fx bug")
        return self._box.pop(key)

    def prefetch(self, src: int, dst: int, channel: str, count: int) -> None:
        """Nothing to post ahead in-process."""

    def finish(self) -> None:
        if self._box:
            left = sorted(self._box)
            self._box.clear()
            raise SMPRuntimeError.build("messages were sent but never received", left[:4],
                                        "end of step", "report this as an smp-fx bug")


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


class DistTransport:
    """torch.distributed point-to-point between the ranks holding each stage.

    ``ranks[s]`` is the global rank holding stage ``s`` of this rank's pipeline.
    ``group``/``out_group`` default to the world group and a duplicate of it; both must be
    created collectively on every rank (``DistTransport.make_groups``).
    """

    def __init__(self, ranks: list[int], stage: int, device: torch.device,
                 timeout_s: float, group: Any = None, out_group: Any = None) -> None:
        self.ranks = ranks
        self.stage = stage
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.group = group
        self.out_group = out_group
        self._pending: list[tuple[Any, Any]] = []
        # The last header sent to / received from each (peer stage, channel): a repeated
        # header (same structure, shapes, dtypes: the usual case) travels as one int64 0.
        # (pickled header, its tensors' metadata, a comparable key of it or None)
        self._sent_header: dict[tuple[int, str],
                                tuple[bytes, list[_TensorMeta], tuple[Any, list[Any]] | None]] = {}
        self._recv_header: dict[tuple[int, str], tuple[Any, list[Any]]] = {}
        # Receives posted ahead (``prefetch``): the next message's flag and tensors, and how
        # many more messages this step may be posted ahead, per (peer stage, channel).
        self._posted: dict[tuple[int, str], tuple[torch.Tensor, Any, list[Any]]] = {}
        self._ahead: dict[tuple[int, str], int] = {}

    @staticmethod
    def make_groups(backend: str | None = None) -> tuple[Any, Any]:
        """The (act/grad, out) groups; collective: call on every rank in the same order."""
        ranks = list(range(dist.get_world_size()))
        return dist.new_group(ranks, backend=backend), dist.new_group(ranks, backend=backend)

    def _group(self, channel: str) -> Any:
        return self.out_group if channel == "out" else self.group

    def send(self, value: Any, src: int, dst: int, channel: str, mb: int) -> None:
        leaves, spec = pytree.tree_flatten(value)
        tensors = [t.detach().contiguous() for t in leaves if isinstance(t, torch.Tensor)]
        header_leaves = [_TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)
                         if isinstance(t, torch.Tensor) else t for t in leaves]
        peer, group = self.ranks[dst], self._group(channel)
        old = self._sent_header.get((dst, channel))
        # The usual message repeats the last one's header: recognise it without pickling
        # when every non-tensor leaf is a plain value (whose == is exact and cheap).
        plain = all(isinstance(x, _TensorMeta) or type(x) in _PLAIN for x in header_leaves)
        key = (spec, [x if isinstance(x, _TensorMeta) else (type(x), x)
                      for x in header_leaves]) if plain else None
        same = old is not None and key is not None and old[2] == key
        payload = b"" if same else pickle.dumps((spec, header_leaves))
        msgs: list[torch.Tensor]
        if same or (old is not None and old[0] == payload):  # receiver has it: say "same"
            msgs = [torch.zeros(1, dtype=torch.int64, device=self.device)] + tensors
        else:
            # The receiver pre-posts receives shaped by the old header: fill them with
            # zeros first, then send the new header and the tensors.
            fill = [torch.zeros(m.shape, dtype=m.dtype, device=self.device)
                    for m in (old[1] if old is not None else [])]
            self._sent_header[(dst, channel)] = (
                payload, [m for m in header_leaves if isinstance(m, _TensorMeta)],
                key)
            msgs = [torch.tensor([len(payload)], dtype=torch.int64, device=self.device)] + \
                fill + [torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                        .to(self.device)] + tensors
        for t in msgs:
            self._pending.append((dist.isend(t, peer, group=group), t))

    def _post(self, src: int, channel: str) -> tuple[torch.Tensor, Any, list[Any]]:
        """Post the next message's receives: the flag, and the tensors if the header is known
        (one round trip, not two)."""
        peer, group = self.ranks[src], self._group(channel)
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        flag_work = dist.irecv(size, peer, group=group)
        cached = self._recv_header.get((src, channel))
        pre: list[tuple[Any, torch.Tensor]] = []
        if cached is not None:
            for leaf in cached[1]:
                if isinstance(leaf, _TensorMeta):
                    t = torch.empty(leaf.shape, dtype=leaf.dtype, device=self.device)
                    pre.append((dist.irecv(t, peer, group=group), t))
        return size, flag_work, pre

    def prefetch(self, src: int, dst: int, channel: str, count: int) -> None:
        """Expect ``count`` messages from ``src`` on ``channel`` this step, and keep the next
        one's receives posted ahead of ``recv``, so the data moves while this rank computes.

        Under NCCL only for a channel with its own process group (``"out"``): receives
        posted early must not queue ahead of this rank's sends to the same peer (NCCL
        serialises a communicator's point-to-point operations). gloo matches each peer's
        receives by order alone, so activations are posted ahead too (a rank receives one
        channel per peer: activations from earlier stages, gradients from later ones).
        Gradients are not: a skipped backward never receives them."""
        key = (src, channel)
        if count <= 0 or key in self._posted or channel == "grad" or (
                channel != "out" and dist.get_backend(self._group(channel)) != "gloo"):
            return
        self._ahead[key] = count - 1
        self._posted[key] = self._post(src, channel)

    def recv(self, src: int, dst: int, channel: str, mb: int) -> Any:
        """Receive one message; with a known header, flag and tensors are received at once."""
        value = self._recv(src, dst, channel, mb)
        key = (src, channel)
        left = self._ahead.get(key, 0)
        if left > 0:  # post the next expected message's receives now
            self._ahead[key] = left - 1
            self._posted[key] = self._post(src, channel)
        return value

    def _recv(self, src: int, dst: int, channel: str, mb: int) -> Any:
        peer, group = self.ranks[src], self._group(channel)
        what = f"{channel} from stage {src} (rank {peer})"
        posted = self._posted.pop((src, channel), None)
        size, flag_work, pre = posted if posted is not None else self._post(src, channel)
        cached = self._recv_header.get((src, channel))
        self._wait(flag_work, what, dst, mb)
        n = int(size.item())
        if n == 0:
            if cached is None:
                raise SMPRuntimeError.build("a repeated header arrived before any header",
                                            what, f"stage {dst} microbatch {mb}",
                                            "report this as an smp-fx bug")
            spec, header_leaves = cached
            for w, _ in pre:
                self._wait(w, what, dst, mb)
            it = iter(t for _, t in pre)
            values = [next(it).requires_grad_(m.requires_grad) if isinstance(m, _TensorMeta)
                      else m for m in header_leaves]
            return pytree.tree_unflatten(values, spec)
        for w, _ in pre:  # the sender's zero fill for our pre-posted receives
            self._wait(w, what, dst, mb)
        data = torch.empty(n, dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(data, peer, group=group), what, dst, mb)
        with warnings.catch_warnings():  # unpickling a LeafSpec warns in torch 2.13
            warnings.simplefilter("ignore", FutureWarning)
            spec, header_leaves = pickle.loads(data.cpu().numpy().tobytes())
        self._recv_header[(src, channel)] = (spec, header_leaves)
        works, leaves = [], []
        for leaf in header_leaves:
            if isinstance(leaf, _TensorMeta):
                t = torch.empty(leaf.shape, dtype=leaf.dtype, device=self.device)
                works.append(dist.irecv(t, peer, group=group))
                leaves.append((t, leaf.requires_grad))
            else:
                leaves.append((leaf, None))
        for w in works:
            self._wait(w, what, dst, mb)
        values = [v.requires_grad_(rg) if rg is not None else v for v, rg in leaves]
        return pytree.tree_unflatten(values, spec)

    def _wait(self, work: Any, what: str, stage: int, mb: int) -> None:
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
        if self._posted:
            left = sorted(self._posted)
            self._posted.clear()
            self._ahead.clear()
            raise SMPRuntimeError.build("receives were posted ahead for messages that never "
                                        "came", left, f"rank {dist.get_rank()} end of step",
                                        "report this as an smp-fx bug")
