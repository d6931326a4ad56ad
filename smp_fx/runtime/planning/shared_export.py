"""One export per host: the ranks of a host that hold the same model export it once.

Every rank captures the whole model at its first step. Where that takes ``torch.export``
(a Hugging Face model), the ranks agree which of them hold the same model on the same host
(``passes.trace_share.digest``, one all-gather of (host, digest) over the world's gloo
group); the lowest such rank exports and sends the graph to the others, which rebuild it
around their own tensors (``passes.trace_share.from_bytes``) instead of exporting. A rank
alone with its model on its host, a model without a digest, a failed export or a graph
that does not load: that rank exports for itself, and says why once per reason (INFO).
``SMP_FX_TRACE_SHARE=0`` turns it off. ``STATS`` counts what this process did: graphs
sent, graphs received, and its own exports by reason.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from cost_model.errors import one_line
from passes.trace_share import available, digest, from_bytes, to_bytes
from smp_fx.world import comm, state

log = logging.getLogger("smp_fx.passes.trace")

ENV = "SMP_FX_TRACE_SHARE"


@dataclass
class ShareStats:
    """Exports this process sent on, graphs it received, and the exports it made for
    itself by reason."""

    sent: int = 0
    received: int = 0
    own: Counter[str] = field(default_factory=Counter)


STATS = ShareStats()


def host_share(st: state.State) -> HostShare | None:
    """The share for this process's planning trace; None in one process or when off."""
    if os.environ.get(ENV, "1") == "0" or st.in_process or st.world_size == 1:
        return None
    return HostShare(st)


class HostShare:
    """``passes.trace_share.ExportShare`` over the ranks of each host."""

    def __init__(self, st: state.State) -> None:
        self.st = st
        self.group = st.object_group("world")

    def run(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            export: Callable[[], torch.fx.GraphModule]) -> torch.fx.GraphModule:
        """Every rank calls this at the same trace (the first step plans on all)."""
        why_not = available()
        mine, why = (None, why_not) if why_not is not None else digest(model, args, kwargs)
        host = socket.gethostname()
        everyone: list[Any] = [None] * self.st.world_size
        comm._bounded("the ranks' model digests", lambda: dist.all_gather_object(
            everyone, (host, mine), group=self.group))
        if mine is None:
            return _own(export, f"this model has no digest: {why}")
        peers = [r for r, held in enumerate(everyone) if tuple(held) == (host, mine)]
        if len(peers) == 1:
            return _own(export, "no other rank on this host holds the same model")
        if self.st.rank == peers[0]:
            return self._lead(model, export, peers[1:])
        return self._follow(model, export, peers[0])

    def _lead(self, model: nn.Module, export: Callable[[], torch.fx.GraphModule],
              peers: list[int]) -> torch.fx.GraphModule:
        try:
            gm = export()
        except Exception:
            self._send(peers, b"")  # they export for themselves (and fail alike)
            raise
        start = time.perf_counter()
        try:
            data = to_bytes(gm, model)
        except Exception as exc:
            log.info("export: the graph cannot be handed on (%s); ranks %s export it too",
                     one_line(exc), peers)
            data = b""
        self._send(peers, data)
        if data:
            STATS.sent += 1
            log.info("export: the graph handed to ranks %s (%.1f MB, %.2f s)", peers,
                     len(data) / 1e6, time.perf_counter() - start)
        return gm

    def _send(self, peers: list[int], data: bytes) -> None:
        size = torch.tensor([len(data)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
        tensors = [size] if payload is None else [size, payload]
        for peer in peers:
            for tensor in tensors:
                self._send_one(tensor, peer)

    def _send_one(self, tensor: torch.Tensor, peer: int) -> None:
        comm._bounded(f"rank {peer} taking the exported graph",
                      lambda: dist.send(tensor, dst=peer, group=self.group))

    def _follow(self, model: nn.Module, export: Callable[[], torch.fx.GraphModule],
                leader: int) -> torch.fx.GraphModule:
        what = f"the graph rank {leader} exports of the same model"
        size = torch.zeros(1, dtype=torch.int64)
        comm._bounded(what, lambda: dist.recv(size, src=leader, group=self.group))
        if int(size.item()) == 0:
            return _own(export, f"rank {leader}'s export failed or could not be handed on")
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        comm._bounded(what, lambda: dist.recv(payload, src=leader, group=self.group))
        start = time.perf_counter()
        try:
            gm = from_bytes(payload.numpy().tobytes(), model)
        except Exception as exc:
            return _own(export, f"rank {leader}'s graph did not load here ({one_line(exc)})")
        STATS.received += 1
        log.info("export: took the graph rank %d exported of the same model (loaded in "
                 "%.2f s)", leader, time.perf_counter() - start)
        return gm


def _own(export: Callable[[], torch.fx.GraphModule], reason: str) -> torch.fx.GraphModule:
    """Export here, saying why once per reason."""
    if reason not in STATS.own:
        log.info("export: this rank exports for itself (%s)", reason)
    STATS.own[reason] += 1
    return export()


__all__ = ["ENV", "STATS", "HostShare", "ShareStats", "host_share"]
