"""How each figure of a calibrated ``DeviceSpec`` is measured: the primitives.

Every timing is the best of several repeats (other load only adds time), on CPU time with
one intra-op thread on a CPU, wall time otherwise; operands rotate through a pool larger
than L2, as a model's weights do. See docs/cli.md, 'smp-fx calibrate'.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from cost_model.device import OpOverheads, OpRates, Table
from cost_model.roofline import GEMM_KINDS


@dataclass(frozen=True)
class Budget:
    """How much to measure: sizes and repeats (``QUICK`` is for specs made at plan time)."""

    matmul_dims: tuple[int, ...]
    matmul_big: int
    elementwise_bytes: tuple[int, ...]
    chain: int
    repeats: int
    target_s: float  # wall time of one repeat; tiny ops are called in a loop to fill it
    op_kinds: tuple[str, ...]
    link_bytes: tuple[int, ...]
    rounds: int = 3
    adam_sizes: tuple[tuple[int, int], tuple[int, int]] = ((32, 16), (4, 2**18))
    """Two (tensors, elements each) Adam steps the per-tensor and per-byte costs are fitted
    from."""


FULL = Budget(matmul_dims=(4, 8, 16, 32, 64, 128, 256, 512), matmul_big=512,
              elementwise_bytes=(3 * 2**12, 3 * 2**16, 3 * 2**20, 3 * 2**24, 3 * 2**26),
              chain=24, repeats=9, target_s=2e-3,
              op_kinds=("default", "module", "view", "linear", "matmul", "bmm", "conv",
                        "layer_norm", "batch_norm", "embedding", "softmax", "sdpa", "gelu",
                        "relu", "tanh"),
              link_bytes=(4, 2**16, 2**22))
ACCELERATOR = dataclasses.replace(
    FULL, matmul_dims=(16, 64, 256, 1024, 4096), matmul_big=4096,
    elementwise_bytes=(3 * 2**12, 3 * 2**16, 3 * 2**20, 3 * 2**24, 3 * 2**28))
"""``FULL`` with the sizes a GPU needs: a call there costs the larger of its launch and its
kernel, so a kernel must outlast the launch by far to be timed (at ``FULL``'s 512, an H100
matmul hides under its launch and the fitted peak came out at 5x the datasheet's)."""
QUICK = Budget(matmul_dims=(16, 64, 192), matmul_big=192,
               elementwise_bytes=(3 * 2**16, 3 * 2**22), chain=6, repeats=3, target_s=2e-4,
               op_kinds=("default", "module", "view", "linear"), link_bytes=(4, 2**20),
               rounds=1, adam_sizes=((32, 16), (4, 2**16)))


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cpu":
        return lambda: None
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
        return functools.partial(torch.accelerator.synchronize, device)
    return functools.partial(torch.cuda.synchronize, device)


def host_overlaps(device: torch.device) -> bool:
    """Whether the host queues the next op while ``device`` runs the last (an accelerator):
    a call then costs the larger of its launch and its kernel, not their sum, so a timed
    kernel keeps its whole time and a model's step is its kernels' time."""
    return device.type != "cpu"


def clock(device: torch.device) -> Callable[[], float]:
    """The clock measurements use: this process's CPU time when all the work is on this
    CPU's one intra-op thread (what the work costs, whatever else the machine runs at the
    time), else wall time (GPU work, or several threads)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.process_time
    return time.perf_counter


def time_per_call(fn: Callable[[], Any], *, repeats: int, target_s: float,
                  sync: Callable[[], None] = lambda: None,
                  now: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call of ``fn``, best of ``repeats``; cheap calls run in a loop long
    enough to time. Best, not median: what else runs on the machine only ever adds time
    (it evicts caches even from a CPU-time measurement), never removes it."""
    fn()
    sync()
    t0 = now()
    fn()
    sync()
    once = max(now() - t0, 1e-7)
    inner = max(1, min(10_000, int(target_s / once)))
    times = []
    for _ in range(repeats):
        sync()
        t0 = now()
        for _ in range(inner):
            fn()
        sync()
        times.append((now() - t0) / inner)
    return min(times)


FLUSH_BYTES = 64 * 2**20
"""Written before each cold call: more than the last-level cache of the CPUs in view."""


def cold_time_per_call(fn: Callable[[], Any], *, repeats: int, device: torch.device) -> float:
    """Seconds of one call after flushing the caches, median of ``repeats``.

    A training step's optimizer runs cold after the backward; fitted cold, Adam's cost
    predicts 0.98-1.18 of in-loop steps (0.64-0.98 fitted hot)."""
    sync, now = synchronizer(device), clock(device)
    flush = torch.empty(FLUSH_BYTES // 4, device=device)
    fn()
    times = []
    for _ in range(repeats):
        flush.fill_(1.0)
        sync()
        t0 = now()
        fn()
        sync()
        times.append(now() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------- fixed op costs


NO_RATE = frozenset({"view", "module"})
"""Kinds that are a fixed cost only (no data moved, or no op of their own)."""


@dataclass(frozen=True)
class Chain:
    """``n`` ops of one kind, each a fresh autograd node, and the work of one of them."""

    run: Callable[[], list[torch.Tensor]]
    units: float  # FLOPs (GEMM kinds) or output elements of one op
    ref: float  # smallest matmul dimension (GEMM kinds) or bytes one op moves


def _chain(kind: str, n: int, device: torch.device, rep: bool = False) -> Chain:
    """``n`` ops of ``kind`` on tiny operands (their fixed cost) or, with ``rep``, on
    operands of a representative size (64 K elements; matmuls of 8-9 MFLOP)."""
    def p(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, requires_grad=True)

    def fold(fn: Callable[[torch.Tensor, Any], torch.Tensor], items: Any,
             start: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
        return lambda: [functools.reduce(fn, items, start)]

    rows, cols = (64, 1024) if rep else (2, 4)
    x = p(rows, cols)
    elems, moved = float(rows * cols), 8.0 * rows * cols
    unary = {"default": lambda v: v * 1.5, "relu": torch.relu, "gelu": F.gelu,
             "tanh": torch.tanh, "softmax": lambda v: torch.softmax(v, -1)}
    if kind in unary:
        return Chain(fold(lambda v, _: unary[kind](v), range(n), x), elems, moved)
    if kind == "view":
        shapes = [(cols, rows), (rows, cols)]
        return Chain(fold(lambda v, i: v.view(shapes[i % 2]), range(n), x), 0.0, 0.0)
    if kind == "module":  # nn.Linear modules; F.linear's own cost is taken off later
        mods = [torch.nn.Linear(4, 4).to(device) for _ in range(n)]
        return Chain(fold(lambda v, m: m(v), mods, p(2, 4)), 0.0, 0.0)
    if kind == "layer_norm":
        ws = [(p(cols), p(cols)) for _ in range(n)]
        return Chain(fold(lambda v, wb: F.layer_norm(v, (cols,), *wb), ws, x), elems, moved)
    if kind == "batch_norm":
        shape = (16, 16, 16, 16) if rep else (2, 4)
        c = shape[1]
        ws = [(p(c), p(c)) for _ in range(n)]
        rm, rv = torch.zeros(c, device=device), torch.ones(c, device=device)
        return Chain(fold(lambda v, wb: F.batch_norm(v, rm, rv, wb[0], wb[1], training=True),
                          ws, p(*shape)), float(math.prod(shape)), 8.0 * math.prod(shape))
    if kind == "embedding":
        rows, width = (1024, 256) if rep else (8, 4)
        idx = torch.arange(64 if rep else 2, device=device) % rows
        tables = [p(rows, width) for _ in range(n)]
        return Chain(lambda: [F.embedding(idx, w) for w in tables],
                     float(idx.numel() * width), 8.0 * idx.numel() * width)
    m, k = (64, 256) if rep else (2, 4)
    if kind == "linear":
        ws = [(p(k, k), p(k)) for _ in range(n)]
        return Chain(fold(lambda v, wb: F.linear(v, *wb), ws, p(m, k)), 2.0 * m * k * k, m)
    if kind == "matmul":
        ys = [p(k, k) for _ in range(n)]
        return Chain(fold(torch.matmul, ys, p(m, k)), 2.0 * m * k * k, m)
    if kind == "bmm":
        b, d = (16, 64) if rep else (2, 4)
        ys = [p(b, d, d) for _ in range(n)]
        return Chain(fold(torch.bmm, ys, p(b, d, d)), 2.0 * b * d ** 3, d)
    if kind == "conv":  # tiny: the smallest a CPU runs on oneDNN's path, as models do
        batch, ch, side = (8, 16, 16) if rep else (2, 4, 4)
        kernels = [p(ch, ch, 3, 3) for _ in range(n)]
        return Chain(fold(lambda v, w: F.conv2d(v, w, padding=1), kernels,
                          p(batch, ch, side, side)),
                     2.0 * batch * ch * side * side * ch * 9, ch)
    if kind == "sdpa":
        heads, length, dim = (16, 64, 32) if rep else (2, 4, 4)
        q = p(1, heads, length, dim)
        return Chain(fold(lambda v, _: F.scaled_dot_product_attention(v, v, v), range(n), q),
                     4.0 * heads * length * length * dim, min(length, dim))
    raise ValueError(f"unknown op kind {kind!r}")


def timer(budget: Budget, device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """``time_per_call`` with the budget's repeats and target and the device's clock."""
    return functools.partial(time_per_call, repeats=budget.repeats, target_s=budget.target_s,
                             sync=synchronizer(device), now=clock(device))


def _fwd_bwd_times(run: Callable[[], list[torch.Tensor]], budget: Budget,
                   device: torch.device) -> tuple[float, float]:
    def fwd() -> None:
        with torch.enable_grad():
            run()

    def both() -> None:
        with torch.enable_grad():
            outs = run()
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    timed = timer(budget, device)
    f = timed(fwd)
    fb = timed(both)
    return f, max(fb - f, 0.0)


def measure_op_costs(budget: Budget, device: torch.device) -> tuple[OpOverheads, OpRates]:
    """Per op kind: its fixed part (a chain of ``n`` tiny ops against one) and its work per
    unit at a reference size (a chain of 4); GEMM backward units count twice."""
    n, reps = budget.chain, 4
    fixed: dict[str, tuple[float, float]] = {}
    rates: list[tuple[str, float, float, float]] = []
    for kind in budget.op_kinds:
        short, long = _chain(kind, 1, device), _chain(kind, n, device)
        big = _chain(kind, reps, device, rep=True) if kind not in NO_RATE else None
        rounds = []
        for _ in range(budget.rounds):  # differences of timings: the median of a few
            f1, b1 = _fwd_bwd_times(short.run, budget, device)
            fn, bn = _fwd_bwd_times(long.run, budget, device)
            fop, bop = (fn - f1) / (n - 1), (bn - b1) / (n - 1)
            work = (0.0, 0.0)
            if big is not None:
                fr, br = _fwd_bwd_times(big.run, budget, device)
                work = ((fr - (f1 - fop)) / reps - fop, (br - (b1 - bop)) / reps - bop)
            rounds.append((fop, bop, *work))
        med = [max(statistics.median(r[i] for r in rounds), 0.0) for i in range(4)]
        fixed[kind] = (med[0], med[1])
        if big is not None and big.units > 0:
            bwd_units = big.units * (2.0 if kind in GEMM_KINDS else 1.0)
            rates.append((kind, med[2] / big.units, med[3] / bwd_units, big.ref))
    if "module" in fixed:  # what calling a module adds to its op (attribute lookups, hooks)
        linear = fixed.get("linear") or measure_op_costs(
            dataclasses.replace(budget, op_kinds=("linear",)), device)[0][0][1:]
        fixed["module"] = (max(fixed["module"][0] - linear[0], 0.0), 0.0)
    return tuple((k, f, b) for k, (f, b) in fixed.items()), tuple(rates)


POOL_BYTES = 8 * 2**20
"""Operands rotate through a pool this large (beyond a CPU core's L2): in a model, a
layer's weights are not in cache when its turn comes, and timing one matrix over and over
would measure a cache-resident one."""


def _two_randn(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, device=device), torch.randn(n, device=device)


def _add_next(operands: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.add(*next(operands))


def _pool(make: Callable[[], Any], nbytes: int) -> Iterator[Any]:
    """An endless cycle over enough copies of ``make()`` (each ``nbytes``) to fill
    ``POOL_BYTES``; a single one when one copy is already that large."""
    copies = max(1, min(1024, POOL_BYTES // max(nbytes, 1)))
    return itertools.cycle([make() for _ in range(copies)])


def matmul_table(timed: Callable[[Callable[[], Any]], float], device: torch.device,
                 dims: tuple[int, ...], big: int, dtype: torch.dtype = torch.float32
                 ) -> tuple[float, Table]:
    """(peak FLOP/s in ``dtype``, efficiency by smallest dimension): ``F.linear`` as models
    run it, the small dimension in each of the three places, averaged; on the CPU less the
    1 x 1 call's fixed part (``host_overlaps``)."""
    def linear_s(m: int, k: int, n: int) -> float:
        x = torch.randn(m, k, device=device, dtype=dtype)
        weights = _pool(lambda: (torch.randn(n, k, device=device, dtype=dtype),
                                 torch.randn(n, device=device, dtype=dtype)),
                        (n * k + n) * x.element_size())
        return timed(lambda: F.linear(x, *next(weights)))

    fixed = 0.0 if host_overlaps(device) else linear_s(1, 1, 1)

    def rate(m: int, k: int, n: int) -> float:
        t = linear_s(m, k, n)
        return 2.0 * m * k * n / max(t - fixed, t * 0.05)

    by_dim: dict[int, float] = {}
    for d in dims:
        shapes = [(d, big, big), (big, d, big), (big, big, d)] if d < big else [(d, d, d)]
        flops = sum(2.0 * m * k * n for m, k, n in shapes)
        by_dim[d] = flops / sum(2.0 * m * k * n / rate(m, k, n) for m, k, n in shapes)
    by_dim[big] = max(by_dim.get(big, 0.0), rate(big, big, big))
    peak = max(by_dim.values())
    return peak, tuple((float(d), by_dim[d] / peak) for d in sorted(by_dim))


def measure_matmul(budget: Budget, device: torch.device) -> tuple[float, float, Table]:
    """(peak fp32 FLOP/s, peak half FLOP/s, fp32 efficiency by smallest dimension)."""
    timed = timer(budget, device)
    peak, table = matmul_table(timed, device, budget.matmul_dims, budget.matmul_big)
    big = budget.matmul_big
    try:
        peak_half = matmul_table(timed, device, (big,), big, torch.bfloat16)[0]
    except RuntimeError:  # no half matmul on this device: the fp32 figure stands in
        peak_half = peak
    return peak, peak_half, table


def measure_elementwise(budget: Budget, device: torch.device) -> tuple[float, Table]:
    """(memory bandwidth, fraction of it each size reaches), allocation included as models
    run it; on the CPU the fixed part of a one-element add is taken off (``host_overlaps``)."""
    timed = timer(budget, device)
    one = torch.ones(1, device=device)
    op_s = 0.0 if host_overlaps(device) else timed(lambda: torch.add(one, one))
    rates = []
    out = None
    for nbytes in budget.elementwise_bytes:
        n = max(1, nbytes // 12)  # a + b reads two and writes one float32 tensor
        operands = _pool(functools.partial(_two_randn, n, device), 8 * n)
        t = timed(functools.partial(_add_next, operands))
        rates.append((float(12 * n), 12.0 * n / max(t - op_s, t * 0.05)))
        a, b = next(operands)
        out = (a, b, torch.empty_like(a))
    assert out is not None
    a, b, c = out
    t = timed(functools.partial(torch.add, a, b, out=c))
    bandwidth = 12.0 * a.numel() / t
    return bandwidth, tuple((b, r / bandwidth) for b, r in rates)


def measure_optimizer(budget: Budget, device: torch.device) -> tuple[float, float]:
    """(seconds per tensor, seconds per parameter byte) of an Adam step."""

    def step_time(count: int, numel: int) -> float:
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(count)]
        for q in params:
            q.grad = torch.randn_like(q)
        opt = torch.optim.Adam(params, lr=1e-3)
        return cold_time_per_call(opt.step, repeats=4 * budget.repeats, device=device)

    (small_n, small_e), (large_n, large_e) = budget.adam_sizes
    ts, tl = step_time(small_n, small_e), step_time(large_n, large_e)
    bs, bl = 4.0 * small_n * small_e, 4.0 * large_n * large_e
    # ts = small_n * c + bs * d; tl = large_n * c + bl * d
    det = small_n * bl - large_n * bs
    c = (ts * bl - tl * bs) / det
    d = (small_n * tl - large_n * ts) / det
    return max(c, 0.0), max(d, 0.0)


# ----------------------------------------------------------------------------- link


def measure_link(budget: Budget, device: torch.device, group: Any = None
                 ) -> tuple[float, float, float]:
    """(latency s, bandwidth bytes/s, per-message s) between ranks 0 and 1 of ``group``.

    Every rank of the group must call it; ranks other than 0 and 1 only join the barriers."""
    rank = dist.get_rank(group)
    peer = {0: 1, 1: 0}.get(rank)
    sync = synchronizer(device)
    one_way: list[float] = []
    for nbytes in budget.link_bytes:
        buf = torch.zeros(max(1, nbytes // 4), device=device)
        times: list[float] = []
        for i in range(budget.repeats * 4 + 2):
            dist.barrier(group)
            t0 = time.perf_counter()
            if peer is not None:
                ping = dist.get_global_rank(group, peer) if group is not None else peer
                if rank == 0:
                    dist.send(buf, ping, group)
                    dist.recv(buf, ping, group)
                else:
                    dist.recv(buf, ping, group)
                    dist.send(buf, ping, group)
                sync()
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)
        one_way.append(statistics.median(times))
    latency = one_way[0]
    span = budget.link_bytes[-1] - budget.link_bytes[0]
    bandwidth = span / max(one_way[-1] - one_way[0], 1e-9)
    count = 64
    tiny = [torch.zeros(1, device=device) for _ in range(count)]
    per_message: list[float] = []
    for _ in range(budget.repeats):
        dist.barrier(group)
        t0 = time.perf_counter()
        if peer is not None:
            ping = dist.get_global_rank(group, peer) if group is not None else peer
            op = dist.isend if rank == 0 else dist.irecv
            works = [op(t, ping, group) for t in tiny]
            for w in works:
                if w is not None:
                    w.wait()
            sync()
        per_message.append((time.perf_counter() - t0) / count)
    dist.barrier(group)
    return latency, bandwidth, statistics.median(per_message)
