"""The in-process pipeline's cross-device copies on each device's own transfer stream.

Where one process runs stages on several accelerators (``cuda:0..p-1``), a stage's output
copied on the current stream would queue behind, and hold up, the sender's next kernels
(torch copies between devices on the source's current stream, fenced both ways with the
destination's). Here each device has a side stream for its copies, ordered by events against
the producer's and the consumer's compute streams. Device-generic torch APIs only; without
them, or with ``SMP_FX_TRANSFER_STREAM=0``, the copy stays on the current stream (logged).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from cost_model.errors import SMPConfigError

log = logging.getLogger("smp_fx.transport")

ENV = "SMP_FX_TRANSFER_STREAM"
_HOSTS = frozenset({"cpu", "meta"})  # no streams: nothing runs beside the copy
_said: set[str] = set()

if TYPE_CHECKING:  # torch.Event is feature-detected, not assumed
    Pending = list[tuple[torch.Tensor, torch.Event]]  # copies a receiver waits for


def wants_transfer_stream(src: torch.device, dst: torch.device) -> bool:
    """Whether a copy ``src -> dst`` takes the transfer streams: two devices of one
    accelerator type. A hand-over on one device (by reference) or through the host keeps
    the plain path: there is no copy between compute streams to overlap."""
    return (src.type == dst.type and src.type not in _HOSTS and src.index is not None
            and dst.index is not None and src.index != dst.index)


def missing_api() -> str | None:
    """What this torch lacks for the device-generic streams (None: nothing)."""
    needed = {"torch.Stream": hasattr(torch, "Stream"), "torch.Event": hasattr(torch, "Event"),
              "torch.accelerator.current_stream":
                  hasattr(getattr(torch, "accelerator", None), "current_stream")}
    missing = [name for name, ok in needed.items() if not ok]
    if not missing and not hasattr(torch.Stream, "__enter__"):
        missing.append("torch.Stream as a context manager")
    return ", ".join(missing) or None


def switched_on(env: Mapping[str, str] | None = None) -> bool:
    """``SMP_FX_TRANSFER_STREAM``: unset or ``1`` on, ``0`` off (the benchmark's baseline)."""
    value = (os.environ if env is None else env).get(ENV, "1").strip() or "1"
    if value not in ("0", "1"):
        raise SMPConfigError.build(f"{ENV} must be 0 or 1", value, "the environment",
                                   f"unset it (on) or set {ENV}=0 (copies on the current "
                                   "stream)")
    return value == "1"


def _say_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        log.warning("in-process pipeline: cross-device copies stay on the current stream: %s",
                    reason)


class TransferStreams:
    """One transfer stream per device, made on first use; ``copies`` counts the copies made
    on them. ``off`` holds why they are not used (the switch, or the torch APIs missing)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        missing = missing_api()
        self.off = (f"{ENV}=0" if not switched_on(env) else
                    f"torch {torch.__version__} lacks {missing}" if missing else None)
        self._streams: dict[torch.device, torch.Stream] = {}
        self.copies = 0

    def usable(self, src: torch.device, dst: torch.device) -> bool:
        """Whether this copy goes on the transfer streams (the first refusal is logged)."""
        if not wants_transfer_stream(src, dst):
            return False
        if self.off is not None:
            _say_once(self.off)
            return False
        return True

    def stream(self, device: torch.device) -> torch.Stream:
        if device not in self._streams:
            self._streams[device] = torch.Stream(device=device)
        return self._streams[device]


def copy_on_transfer_streams(t: torch.Tensor, dst: torch.device,
                             streams: TransferStreams) -> tuple[torch.Tensor, torch.Event]:
    """``t`` copied to ``dst`` on the two devices' transfer streams, and the event the
    consumer waits on (``consume``). Buys: the sender's next kernels and the receiver's
    pending ones no longer queue behind the copy, which overlaps both. The gain is a GPU
    figure, unmeasured until ``benchmarks/gpu_check.py`` runs on two GPUs."""
    src = t.device
    side_src, side_dst = streams.stream(src), streams.stream(dst)
    side_src.wait_stream(torch.accelerator.current_stream(src))  # the producer's kernels
    with side_src, side_dst:  # copy on side_src, fenced both ways with side_dst
        out = t.to(dst, non_blocking=True)
        done = side_dst.record_event()
    t.record_stream(side_src)  # its memory is not reused before the copy has read it
    streams.copies += 1
    return out, done


def consume(received: Pending, device: torch.device) -> None:
    """The consumer's current (compute) stream waits for its copies' events, at its turn;
    each copy, allocated on a transfer stream, is not reused before that stream is done."""
    if not received:
        return
    compute = torch.accelerator.current_stream(device)
    for out, done in received:
        compute.wait_event(done)
        out.record_stream(compute)


__all__ = ["ENV", "TransferStreams", "consume", "copy_on_transfer_streams", "missing_api",
           "switched_on", "wants_transfer_stream"]
