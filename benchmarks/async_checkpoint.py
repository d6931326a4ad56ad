"""What a checkpoint costs the training loop: asynchronous save vs synchronous save.

4 processes by default, pp=2 x dp=2 ("cluster", ``ddp: true``), gloo on CPU (or NCCL when
there is one GPU per process). The model is an MLP chain trained with Adam: parameters
plus Adam's two moments make ``--hidden``/``--layers``' state (default 2048 x 5: 84 MB
of parameters, 252 MB of state). Measured, each as the slowest rank's time (a barrier
before each, the ranks' times max-reduced):

* a plain training step (forward, backward, optimizer step), ``--steps`` of them;
* the ``save_checkpoint(async_save=True)`` call alone, the step that starts an asynchronous
  save (that call plus the step after it), and every later step while that save is being
  written, until its commit at a step's end;
* the stall of a synchronous ``save_checkpoint`` (the call alone), its dirty pages then
  written back (``os.sync``, untimed) so that they do not slow the next plain steps.

``--control`` makes no asynchronous save (the call does nothing, three steps follow): the
same ratios then read the noise floor of the machine (1.00 on a quiet one).

Rank 0 prints medians and their ratios to the plain step's, and the paired ratios (the
median over saves of each save's figure over the median of the plain steps just before it,
which the machine's drifting load biases less), then where each rank's time goes
(``_clock``: wall and thread CPU seconds per save of the call's parts on the training thread,
of the writer thread's copies, its wait for the next step and its file writes, of the
optimizer step's wait for those copies, of the agreement at the steps while a save is in
flight and of world rank 0's commit on its thread); ``--each`` prints each save's paired
ratios too. A
thread's CPU seconds bound the time it holds the GIL: the writer's copies and large writes
(``torch.save``'s tensor records, ``os.pwrite``, ``os.fsync``) release it. Saves go to
``--dir`` (a temporary folder by default; use a real disk to measure one).

Run: ``.venv/bin/python benchmarks/async_checkpoint.py [--saves 3 --hidden 2048 ...]``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ddp_overlap import build  # the same MLP chain
from torch import nn

ROOT = Path(__file__).resolve().parents[1]


def _clock(parts: dict[str, list[float]], owner: Any, name: str, key: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its wall and thread CPU seconds to
    ``parts[key]`` (the caller's thread: the training or the writer thread)."""
    fn = getattr(owner, name)

    def timed(*a: Any, **k: Any) -> Any:
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            got = parts.setdefault(key, [0.0, 0.0])
            got[0] += time.perf_counter() - w0
            got[1] += time.thread_time() - c0

    setattr(owner, name, timed)


PARTS = (  # (label, key): the call's parts on the training thread, then the writer thread's
    ("call: staging folder (rank 0)", "staging"), ("call: local state dicts", "states"),
    ("call: copy off the live tensors", "copy"), ("call: the one gather", "gather"),
    ("writer: the copies (deferred ones taken)", "ready"),
    ("writer: held until the next step", "hold"),
    ("step: the optimizer waits for the copies", "copywait"),
    ("writer: files (serialize, write, fsync)", "write"),
    ("steps: the writers' agreement", "agree"),
    ("commit thread: commit (world rank 0)", "commit"))


def _worker(args: argparse.Namespace) -> Any:
    """This rank's part (one of ``run_ranks``'s): the figures, the slowest rank's times."""
    torch.set_num_threads(args.threads)
    import smp_fx as smp
    from smp_fx.ckpt import async_save, checkpoint_api, snapshot
    from smp_fx.world import state

    smp.init({"pipeline_parallel_degree": 2, "microbatches": args.microbatches,
              "ddp": True, "placement_strategy": "cluster"})
    device = state.get().device
    per_rank = args.batch // smp.dp_size()
    torch.manual_seed(0)
    x = torch.randn(per_rank, args.hidden, device=device)
    y = torch.randint(0, 10, (per_rank,), device=device)
    model = smp.DistributedModel(build(args.hidden, args.layers))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-5))
    group = smp.get_world_process_group()

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        loss = nn.functional.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    def step() -> None:
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()

    def timed(fn: Any) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
        return float(took)

    for _ in range(args.warmup):
        step()
    state_mb = sum(t.numel() * t.element_size() for t in model.local_state_dict().values()
                   if isinstance(t, torch.Tensor))
    state_mb += sum(t.numel() * t.element_size() for s in opt.state.values()
                    for t in s.values() if isinstance(t, torch.Tensor))
    totals = [0.0] * smp.size()
    dist.all_gather_object(totals, state_mb / 1e6, group=group)
    times: dict[str, list[float]] = {"plain": [], "call": [], "starts": [], "during": [],
                                     "sync": []}
    per_phase = max(1, args.steps // args.saves)

    def save(tag: str, background: bool) -> None:
        smp.save_checkpoint(args.dir, tag, model=model, optimizer=opt, async_save=background)

    parts: dict[str, list[float]] = {}
    api = checkpoint_api
    for owner, name, key in ((api, "_fresh_folder", "staging"),
                             (api, "_collect_states", "states"),
                             (api._snapshot, "take", "copy"), (api, "one_gather", "gather"),
                             (api._snapshot, "ready", "ready"),
                             (async_save, "hold_writes", "hold"),
                             (snapshot, "wait_copied", "copywait"),
                             (async_save, "write_file", "write"),
                             (async_save, "at_step", "agree"),
                             (async_save, "after_step", "agree"), (api, "commit", "commit")):
        _clock(parts, owner, name, key)

    def saved(n: int) -> None:
        """The parts of the asynchronous save a{n}, this rank's, kept; the clocks reset."""
        per_save.append({k: tuple(v) for k, v in parts.items()})
        parts.clear()

    per_save: list[dict[str, tuple[float, ...]]] = []
    paired: dict[str, list[float]] = {k: [] for k in ("call", "starts", "during", "sync")}
    for n in range(args.saves):
        plain = [timed(step) for _ in range(per_phase)]
        times["plain"] += plain
        call = timed(functools.partial(save, f"a{n}", True) if not args.control else list)
        times["call"].append(call)
        times["starts"].append(call + timed(step))
        during: list[float] = []
        while (async_save.in_flight() == f"a{n}_partial" if not args.control  # committed
               else len(during) < 3):  # at a step's end
            during.append(timed(step))
        times["during"] += during
        saved(n)
        times["sync"].append(timed(functools.partial(save, f"s{n}", False)))
        os.sync()  # its dirty pages written back now, not during the next plain steps
        parts.clear()
        base = statistics.median(plain)  # the plain steps just before: the load drifts
        for key, took in (("call", call), ("starts", times["starts"][-1]),
                          ("during", statistics.median(during) if during else None),
                          ("sync", times["sync"][-1])):
            if took is not None:
                paired[key].append(took / base)
    smp.wait_checkpoint()
    breakdown = {k: [statistics.median(s.get(k, (0.0, 0.0))[i] for s in per_save)
                     for i in (0, 1)] for _, k in PARTS}
    every: list[Any] = [None] * smp.size()
    dist.all_gather_object(every, breakdown, group=group)
    return {"times": times, "state_mb": totals, "parts": every, "paired": paired}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="plain steps, over all saves")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--control", action="store_true",
                    help="no asynchronous save: the same timings read the noise floor")
    ap.add_argument("--each", action="store_true", help="print each save's paired ratios")
    ap.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = args.dir or tmp
        sys.path.insert(0, str(ROOT))
        from tests.helpers.dist import run_ranks

        got = run_ranks(_worker, 4, args, timeout=1800)[0]
    times, state = got["times"], got["state_mb"]
    plain = statistics.median(times["plain"])
    print(f"pp 2 x dp 2, MLP {args.layers} x {args.hidden}, Adam: state {sum(state) / 2:.0f} "
          f"MB per replica (per rank: {', '.join(f'{s:.0f}' for s in state)} MB)")
    print(f"{'measured':34s} {'n':>3s} {'median s':>9s} {'x plain':>8s} {'paired':>7s}")
    rows = (("plain step", "plain"), ("async save call (stall)", "call"),
            ("step that starts an async save", "starts"),
            ("steps while it is written", "during"), ("synchronous save (stall)", "sync"))
    for label, key in rows:
        if times[key]:
            med = statistics.median(times[key])
            pair = got["paired"].get(key)
            told = f"{statistics.median(pair):7.2f}" if pair else f"{1.0:7.2f}"
            print(f"{label:34s} {len(times[key]):3d} {med:9.3f} {med / plain:8.2f} {told}")
    if args.each:
        for key in ("call", "starts", "during", "sync"):
            print(key, " ".join(f"{v:.2f}" for v in got["paired"][key]))
    print(f"steps per async save until committed: {len(times['during']) / args.saves:.1f}")
    print("where the time goes, per asynchronous save (medians), wall / thread CPU s, "
          "ranks " + ", ".join(str(r) for r in range(len(got["parts"]))))
    for label, key in PARTS:
        cells = "  ".join(f"{p[key][0]:6.3f} /{p[key][1]:6.3f}" for p in got["parts"])
        print(f"{label:42s} {cells}")


if __name__ == "__main__":
    main()
