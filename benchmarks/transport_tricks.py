"""What each of the runtime's speed tricks buys, one process, no torch.distributed.

Each row times the trick against the plain way on the message sizes of
``benchmarks/pipeline_vs_torch.py`` (MLP width 512, batch 128, 4 microbatches: a 32 x 512
fp32 activation, 64 KiB, per message), median of ``--repeat`` rounds:

- *flag read*: ``wire.flag_at`` (ctypes, at the frame's address) vs slicing and viewing;
- *lowering lookup*: ``LoweredCache.get`` on the step's very schedule object (identity) vs
  a lookup that hashes the schedule (an equal, distinct object);
- *send frame*: ``DistTransport._reused_send_frame`` reusing the last step's frame vs a
  new frame with its slot views;
- *one-tensor send*: ``DistTransport._send_direct``'s work before the send (the tensor
  itself) vs a reused frame and the copy into it;
- *one-tensor receive*: the received tensor made at posting, ``wire.direct_view`` (one
  ``as_strided`` of a frame of its dtype) vs ``wire.slot`` (slice and two views);
- *frame views*: a gradient message's two tensors (32 x 512 and 32 x 10) viewed out of
  its frame at posting, ``wire.received_views`` (``strided_slot``) vs a ``slot`` each.

(The receive side's ``BufferPool`` is measured on the pipeline benchmark itself: what it
saves is the page faults of a whole step's frames freed in bulk, which a loop here does
not reproduce; see docs/performance.md.)

    python benchmarks/transport_tricks.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _per_call(fn: Callable[[], object], number: int, repeat: int) -> float:
    """Median seconds per call over ``repeat`` rounds of ``number`` calls."""
    return statistics.median(t / number for t in timeit.repeat(fn, number=number,
                                                                repeat=repeat))


def _two_stages() -> Any:
    """A 2-stage program (the lowering only reads its transfers)."""
    import torch.fx
    from torch import nn

    from passes import meta
    from passes.split_stages import split_stages

    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    for n in gm.graph.nodes:
        if n.op == "call_module":
            meta.STAGE.set(n, int(n.target))
    return split_stages(gm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from cost_model import schedule as sched
    from smp_fx.runtime.executor.lowering import LoweredCache, cached_schedule
    from smp_fx.runtime.transport import wire
    from smp_fx.runtime.transport.dist_transport import DistTransport

    rows: list[tuple[str, float, float]] = []
    r = args.repeat

    frame = torch.zeros(64 * 1024 + 64, dtype=torch.uint8)
    addr = frame.data_ptr()
    rows.append(("flag read", _per_call(lambda: wire.flag_at(addr), 20000, r),
                 _per_call(lambda: wire.read_flag(frame), 20000, r)))

    cache = LoweredCache(_two_stages(), multi_process=True)
    s = cached_schedule("interleaved", 2, 4, 4, False)
    equal = sched.generate("interleaved", 2, 4, 4)
    cache.get(s, (0,))

    def by_hash() -> None:
        cache.get(equal, (0,))  # an equal schedule: found by hash ...
        cache.get(s, (0,))  # ... and back, so the next call misses the identity check too

    rows.append(("lowering lookup", _per_call(lambda: cache.get(s, (0,)), 20000, r),
                 _per_call(by_hash, 10000, r) / 2))

    tr = DistTransport([0, 1], 0, torch.device("cpu"), 30.0)
    act = torch.randn(32, 512)
    header = wire.encode(wire.flatten((act,)))

    def reused() -> None:
        tr._send_count.clear()
        tr._reused_send_frame((0, 1, "act"), header)

    def fresh() -> None:
        frame = torch.empty(header.frame_size, dtype=torch.uint8)
        wire.write_flag(frame, 0)
        wire.send_slots(frame, header)

    rows.append(("send frame", _per_call(reused, 20000, r), _per_call(fresh, 20000, r)))

    def framed() -> None:
        tr._send_count.clear()
        out = tr._reused_send_frame((0, 1, "act"), header)
        wire.pack(header, out.views, (act,))

    rows.append(("one-tensor send", _per_call(lambda: act if act.is_contiguous() else
                                              act.contiguous(), 20000, r),
                 _per_call(framed, 5000, r)))
    direct = wire.encode(wire.flatten((act,)), direct=True)
    typed = torch.empty(direct.frame_size // 4)
    raw = torch.empty(header.frame_size, dtype=torch.uint8)
    meta = header.metas[0]
    rows.append(("one-tensor receive", _per_call(lambda: wire.direct_view(typed, direct),
                                                 20000, r),
                 _per_call(lambda: wire.slot(raw, 64, meta.nbytes, meta), 20000, r)))
    grad = wire.encode(wire.flatten(((act,), (torch.randn(32, 10),))))
    graw = torch.empty(grad.frame_size, dtype=torch.uint8)

    def slots() -> None:
        for m, off, n in zip(grad.metas, grad.offsets, grad.nbytes):
            wire.slot(graw, off or 0, n, m)

    rows.append(("frame views", _per_call(lambda: wire.received_views(graw, grad, ()),
                                          20000, r), _per_call(slots, 20000, r)))

    print(f"median of {r} rounds, one thread; us per call")
    print(f"{'trick':<22} {'with':>9} {'without':>9} {'saves':>9}")
    for name, with_, without in rows:
        print(f"{name:<22} {with_ * 1e6:>9.2f} {without * 1e6:>9.2f} "
              f"{(without - with_) * 1e6:>9.2f}")


if __name__ == "__main__":
    main()
