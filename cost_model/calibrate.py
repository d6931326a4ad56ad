"""Measure the machine this process runs on into a ``DeviceSpec``.

What the cost model needs and how each figure is taken (median of repeats, one process,
the torch thread count it runs with):

- matmul: ``torch.mm`` with the smallest of (m, k, n) in ``dims`` and the other two
  ``big`` (each orientation), and ``big`` cubed; the best rate is the peak, each smallest
  dimension gets its fraction of it (``DeviceSpec.matmul_efficiency``).
- element-wise: ``a + b`` over tensors of several sizes; the largest gives
  ``mem_bandwidth``, each size its fraction of it (cache-resident sizes beat it).
- per-op fixed cost: a chain of ``n`` tiny ops against a chain of one, forward and
  forward + backward, for each op kind in ``OP_KINDS``; the difference over ``n - 1`` is
  the cost of one op with its autograd bookkeeping and no arithmetic to speak of.
- optimizer: ``torch.optim.Adam`` steps over many tiny and a few large tensors, solved for
  a per-tensor and a per-byte cost.
- link (``measure_link``, with a process group of two or more ranks): ping-pong between
  ranks 0 and 1 gives latency and bandwidth; a stream of tiny messages gives the time a
  rank spends per message.

The smp-fx runtime's own overheads (per action, per step) need the runtime, which this
layer may not import: ``smp-fx calibrate`` measures them and fills them in.

Example::

    spec = calibrate(quick=True)       # about 0.5 s on a CPU
    spec.to_json()                     # what `smp-fx calibrate -o FILE.json` writes
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from cost_model.device import DeviceSpec, GiB, OpOverheads, OpRates, Table
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


FULL = Budget(matmul_dims=(4, 8, 16, 32, 64, 128, 256, 512), matmul_big=512,
              elementwise_bytes=(3 * 2**12, 3 * 2**16, 3 * 2**20, 3 * 2**24, 3 * 2**26),
              chain=24, repeats=9, target_s=2e-3,
              op_kinds=("default", "module", "view", "linear", "matmul", "bmm", "conv",
                        "layer_norm", "batch_norm", "embedding", "softmax", "sdpa", "gelu",
                        "relu", "tanh"),
              link_bytes=(4, 2**16, 2**22))
QUICK = Budget(matmul_dims=(16, 64, 192), matmul_big=192,
               elementwise_bytes=(3 * 2**16, 3 * 2**22), chain=6, repeats=3, target_s=2e-4,
               op_kinds=("default", "module", "view", "linear"), link_bytes=(4, 2**20),
               rounds=1)


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


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
        return Chain(fold(lambda v, wb: F.batch_norm(v, rm, rv, *wb, training=True), ws,
                          p(*shape)), float(math.prod(shape)), 8.0 * math.prod(shape))
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
    if kind == "conv":
        batch, ch, side = (8, 16, 16) if rep else (1, 2, 4)
        ws = [p(ch, ch, 3, 3) for _ in range(n)]
        return Chain(fold(lambda v, w: F.conv2d(v, w, padding=1), ws, p(batch, ch, side, side)),
                     2.0 * batch * ch * side * side * ch * 9, ch)
    if kind == "sdpa":
        heads, length, dim = (16, 64, 32) if rep else (2, 4, 4)
        q = p(1, heads, length, dim)
        return Chain(fold(lambda v, _: F.scaled_dot_product_attention(v, v, v), range(n), q),
                     4.0 * heads * length * length * dim, min(length, dim))
    raise ValueError(f"unknown op kind {kind!r}")


def _fwd_bwd_times(run: Callable[[], list[torch.Tensor]], budget: Budget,
                   device: torch.device) -> tuple[float, float]:
    def fwd() -> None:
        with torch.enable_grad():
            run()

    def both() -> None:
        with torch.enable_grad():
            outs = run()
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    timing = {"repeats": budget.repeats, "target_s": budget.target_s, "sync": _sync(device),
              "now": clock(device)}
    f = time_per_call(fwd, **timing)
    fb = time_per_call(both, **timing)
    return f, max(fb - f, 0.0)


def measure_op_costs(budget: Budget, device: torch.device) -> tuple[OpOverheads, OpRates]:
    """Per op kind: (kind, forward s, backward s) of its fixed part, a chain of ``n`` tiny
    ops against a chain of one; and (kind, forward s, backward s per unit, reference size)
    of its work, from a chain of 4 representative ops (the fixed part and the chain's own
    cost taken off). A backward unit is a forward one, times 2 for GEMM kinds (the
    gradients of both operands), as ``cost_model.flops`` counts them."""
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


def _pool(make: Callable[[], Any], nbytes: int) -> Iterator[Any]:
    """An endless cycle over enough copies of ``make()`` (each ``nbytes``) to fill
    ``POOL_BYTES``; a single one when one copy is already that large."""
    copies = max(1, min(1024, POOL_BYTES // max(nbytes, 1)))
    return itertools.cycle([make() for _ in range(copies)])


def measure_matmul(budget: Budget, device: torch.device) -> tuple[float, float, Table]:
    """(peak fp32 FLOP/s, peak half FLOP/s, efficiency by smallest dimension).

    Timed as models run matmuls: ``F.linear`` (a weight stored (out, in), and a bias),
    less the time of the same call on 1 x 1 matrices (the fixed part, which
    ``measure_op_overheads`` prices with its autograd bookkeeping).
    """
    big = budget.matmul_big
    timing = {"repeats": budget.repeats, "target_s": budget.target_s, "sync": _sync(device),
              "now": clock(device)}

    def linear_s(m: int, k: int, n: int, dtype: torch.dtype) -> float:
        x = torch.randn(m, k, device=device, dtype=dtype)
        weights = _pool(lambda: (torch.randn(n, k, device=device, dtype=dtype),
                                 torch.randn(n, device=device, dtype=dtype)),
                        (n * k + n) * x.element_size())
        return time_per_call(lambda: F.linear(x, *next(weights)), **timing)

    fixed = {torch.float32: linear_s(1, 1, 1, torch.float32)}

    def rate(m: int, k: int, n: int, dtype: torch.dtype = torch.float32) -> float:
        if dtype not in fixed:
            fixed[dtype] = linear_s(1, 1, 1, dtype)
        t = linear_s(m, k, n, dtype)
        return 2.0 * m * k * n / max(t - fixed[dtype], t * 0.05)

    by_dim: dict[int, float] = {}
    for d in budget.matmul_dims:
        shapes = [(d, big, big), (big, d, big), (big, big, d)] if d < big else [(d, d, d)]
        flops = sum(2.0 * m * k * n for m, k, n in shapes)
        seconds = sum(2.0 * m * k * n / rate(m, k, n) for m, k, n in shapes)
        by_dim[d] = flops / seconds
    by_dim[big] = max(by_dim.get(big, 0.0), rate(big, big, big))
    peak = max(by_dim.values())
    try:
        peak_half = rate(big, big, big, torch.bfloat16)
    except RuntimeError:  # no half matmul on this device: the fp32 figure stands in
        peak_half = peak
    table = tuple((float(d), by_dim[d] / peak) for d in sorted(by_dim))
    return peak, peak_half, table


def measure_elementwise(budget: Budget, device: torch.device) -> tuple[float, Table]:
    """(memory bandwidth, fraction of it each size reaches).

    The bandwidth is ``a + b`` into an existing output at the largest size (streaming
    memory); the fractions time ``a + b`` as models run it, allocating its output, so
    they include what allocation costs (page faults of large fresh buffers on a CPU).
    The time of the same add on one element (the fixed part) is taken off.
    """
    timing = {"repeats": budget.repeats, "target_s": budget.target_s, "sync": _sync(device),
              "now": clock(device)}
    one = torch.ones(1, device=device)
    op_s = time_per_call(lambda: torch.add(one, one), **timing)
    rates = []
    out = None
    for nbytes in budget.elementwise_bytes:
        n = max(1, nbytes // 12)  # a + b reads two and writes one float32 tensor
        operands = _pool(lambda n=n: (torch.randn(n, device=device),
                                      torch.randn(n, device=device)), 8 * n)
        t = time_per_call(lambda ops=operands: torch.add(*next(ops)), **timing)
        rates.append((float(12 * n), 12.0 * n / max(t - op_s, t * 0.05)))
        a, b = next(operands)
        out = (a, b, torch.empty_like(a))
    assert out is not None
    a, b, c = out
    t = time_per_call(functools.partial(torch.add, a, b, out=c), **timing)
    bandwidth = 12.0 * a.numel() / t
    return bandwidth, tuple((b, r / bandwidth) for b, r in rates)


def measure_optimizer(budget: Budget, device: torch.device) -> tuple[float, float]:
    """(seconds per tensor, seconds per parameter byte) of an Adam step."""
    sync = _sync(device)

    def step_time(count: int, numel: int) -> float:
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(count)]
        for q in params:
            q.grad = torch.randn_like(q)
        opt = torch.optim.Adam(params, lr=1e-3)
        return time_per_call(opt.step, repeats=budget.repeats, target_s=budget.target_s,
                             sync=sync, now=clock(device))

    small_n, small_e = 32, 16
    large_n, large_e = 4, 2**18 if budget is FULL else 2**16
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

    Every rank of the group must call it; ranks other than 0 and 1 only join the barriers.
    """
    rank = dist.get_rank(group)
    peer = {0: 1, 1: 0}.get(rank)
    sync = _sync(device)
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
                w.wait()
            sync()
        per_message.append((time.perf_counter() - t0) / count)
    dist.barrier(group)
    return latency, bandwidth, statistics.median(per_message)


# ------------------------------------------------------------------------ the spec


ADAM_OPS, ADAM_BYTES = 12, 16.0
"""A single-tensor Adam step: about 12 ops per tensor moving 16 bytes per parameter byte
(lerp, mul, addcmul, sqrt, div, addcdiv, the step counter); the quick estimate."""

LOOPBACK = DeviceSpec(
    "cpu", 1e11, 1e11, 1e10, 16 * GiB, 5e9, 50e-6, message_overhead_s=50e-6,
    microbatch_overhead_s=150e-6, step_overhead_s=500e-6,
    sources=(("link_bandwidth", "estimate for gloo over loopback; `smp-fx calibrate "
                                "--nproc 2` measures it"),
             ("link_latency_s", "estimate for gloo over loopback"),
             ("message_overhead_s", "estimate: posting a gloo send or receive costs "
                                    "30-90 us of a rank's time (docs/architecture.md)"),
             ("microbatch_overhead_s", "estimate of the smp-fx runtime per action on a "
                                       "small CPU; `smp-fx calibrate` measures it"),
             ("step_overhead_s", "estimate of the smp-fx runtime per step on a small CPU; "
                                 "`smp-fx calibrate` measures it")))
"""Starting point of a CPU calibration: what is not measured keeps these estimates."""


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def calibrate(name: str = "cpu", device: torch.device | str = "cpu", *,
              quick: bool = False, link: bool = False, group: Any = None,
              base: DeviceSpec | None = None) -> DeviceSpec:
    """Measure ``device`` into a ``DeviceSpec`` called ``name``.

    With ``link`` (torch.distributed initialised, ``group`` of two or more ranks, None for
    the default group; every rank calls this) the link figures are measured between the
    group's ranks 0 and 1; otherwise they, and the runtime's overheads, come from ``base``
    (``LOOPBACK``, gloo-over-loopback estimates, by default).
    """
    device = torch.device(device)
    budget = QUICK if quick else FULL
    ops, rates = measure_op_costs(budget, device)
    op_s = dict((k, f) for k, f, _ in ops)
    peak, peak_half, mm_table = measure_matmul(budget, device)
    bandwidth, ew_table = measure_elementwise(budget, device)
    if quick:  # constructing the first optimizer imports for seconds: estimate it
        opt_tensor, opt_byte = ADAM_OPS * op_s["default"], ADAM_BYTES / bandwidth
    else:
        opt_tensor, opt_byte = measure_optimizer(budget, device)
    how = (f"measured by cost_model.calibrate ({'quick' if quick else 'full'}) on "
           f"{device.type}, {torch.get_num_threads()} thread(s)")
    start = base or LOOPBACK
    spec = dataclasses.replace(
        start, name=name, peak_flops_fp32=peak, peak_flops_bf16=peak_half,
        mem_bandwidth=bandwidth, memory_bytes=_memory_bytes(device),
        matmul_efficiency=mm_table, elementwise_efficiency=ew_table, op_overheads=ops,
        op_rates=rates,
        optimizer_tensor_s=opt_tensor, optimizer_byte_s=opt_byte)
    measured = ["peak_flops_fp32", "peak_flops_bf16", "mem_bandwidth", "memory_bytes",
                "matmul_efficiency", "elementwise_efficiency", "op_overheads", "op_rates"]
    estimate = (f"estimate: a single-tensor Adam step is about {ADAM_OPS} ops per tensor and "
                f"{ADAM_BYTES:.0f} bytes moved per parameter byte, at the measured op cost "
                "and bandwidth")
    optimizer = {k: estimate if quick else how for k in ("optimizer_tensor_s",
                                                         "optimizer_byte_s")}
    spec = spec.with_sources(**{k: how for k in measured}, **optimizer)
    if link:
        latency, link_bw, per_msg = measure_link(budget, device, group)
        spec = dataclasses.replace(spec, link_latency_s=latency, link_bandwidth=link_bw,
                                   message_overhead_s=per_msg)
        backend = dist.get_backend(group)
        spec = spec.with_sources(**{k: f"{how}, {backend} between ranks 0 and 1" for k in
                                    ("link_latency_s", "link_bandwidth",
                                     "message_overhead_s")})
    return spec


@functools.lru_cache(maxsize=1)
def quick_cpu_spec() -> DeviceSpec:
    """The built-in "cpu" spec: a quick calibration of this CPU, once per process."""
    return calibrate("cpu", "cpu", quick=True)


def figures(spec: DeviceSpec) -> list[tuple[str, str]]:
    """Human-readable (figure, value) rows of a spec, for the CLI."""
    rows = [("peak fp32", f"{spec.peak_flops_fp32 / 1e9:.1f} GFLOP/s"),
            ("memory bandwidth", f"{spec.mem_bandwidth / 1e9:.1f} GB/s"),
            ("link", f"{spec.link_bandwidth / 1e9:.2f} GB/s, "
                     f"{spec.link_latency_s * 1e6:.1f} us latency, "
                     f"{spec.message_overhead_s * 1e6:.1f} us per message"),
            ("runtime", f"{spec.microbatch_overhead_s * 1e6:.0f} us per action, "
                        f"{spec.step_overhead_s * 1e6:.0f} us per step"),
            ("optimizer (Adam)", f"{spec.optimizer_tensor_s * 1e6:.1f} us per tensor + "
                                 f"{spec.optimizer_byte_s * 1e12:.1f} ps per byte")]
    rows += [(f"matmul, smallest dim {int(d)}", f"{f:.0%} of peak")
             for d, f in spec.matmul_efficiency]
    rows += [(f"op {k}", f"{fw * 1e6:.1f} us fwd, {bw * 1e6:.1f} us bwd")
             for k, fw, bw in spec.op_overheads]
    for kind, fw, bw, _ in spec.op_rates:
        if kind in GEMM_KINDS:
            rows.append((f"work {kind}", f"{1e-9 / max(fw, 1e-30):.1f} GFLOP/s fwd, "
                                         f"{1e-9 / max(bw, 1e-30):.1f} bwd"))
        else:
            rows.append((f"work {kind}", f"{fw * 1e9:.2f} ns fwd, {bw * 1e9:.2f} ns bwd "
                                         "per element"))
    return rows
