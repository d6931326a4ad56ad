"""The GEMMs the planner prices for public runs, timed on a GPU: priced against cuBLAS.

Why: the Hopper matmul table (``cost_model.gpu_specs.HOPPER_MATMUL``) is indexed by one
dimension, measured with the other two at 8192, and a GEMM's shape enters only through its
wave quantization (``cost_model.waves``). Whether cuBLAS runs the shapes of the H100 runs
``benchmarks/plan_validation.py`` judges as fast as that prices them can only be settled
by timing them, which this does in three steps:

- ``collect`` (CPU, seconds a run): each run of ``benchmarks/data/public_runs.csv`` on one
  GPU type is planned as ``plan_validation.py`` plans it; its graph as one
  tensor-parallel rank of the plan runs it (``smp_fx.planner.profile.rank_graph``) gives
  every GEMM of one repeated layer and of the head and tail with the shape it runs and
  the forward and backward time the planner gives it;
- ``time`` (a GPU): each distinct shape timed in bf16 in the three GEMMs a linear runs
  (forward ``x W^T``, input gradient ``g W``, weight gradient ``g^T x``), CUDA events, the
  median of ``--repeats`` means of ``--calls`` calls; ``--grid`` adds a grid of shapes
  (tokens x contraction x outputs) that no run chose. A GEMM an FP8 row runs in FP8
  (``passes.fp8_linears``) is timed as ``torch._scaled_mm`` in float8_e4m3fn with the
  casts priced beside it (``cost_model.roofline.fp8_cast_times``): the forward with its
  input's, the input gradient with the output gradient's (each cast and transposed copy
  a kernel of its own, where Transformer Engine runs one: an upper bound);
- ``compare``: per run, the GEMMs of a layer priced and measured, and per shape the
  measured share of the dense bf16 peak beside the priced one.

    PYTHONPATH=. .venv/bin/python benchmarks/gemm_shapes.py collect --gpu H100 --out s.json
    PYTHONPATH=. python3 benchmarks/gemm_shapes.py time s.json --grid --out t.json   # GPU
    PYTHONPATH=. .venv/bin/python benchmarks/gemm_shapes.py compare s.json t.json

``time --tiny`` runs on the CPU in float32 on a few small shapes: it checks the script,
not the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

FORMS = ("forward", "input_grad", "weight_grad")
"""The three GEMMs of a linear ``y = x W^T`` with x (m, k), W (n, k): forward (m, k) x
(k, n), input gradient (m, n) x (n, k), weight gradient (n, m) x (m, k)."""
GRID_M = (1024, 2048, 4096, 8192, 16384)
GRID_KN = (512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
PART_NAMES = ("head", "first layer", "layer", "tail")
"""``split_parts``' parts of a graph with repeated layers, in order."""


def _key(m: int, k: int, n: int, batch: int, fp8: bool = False, casts: bool = True) -> str:
    """A shape's name; an FP8 one's says whether its input's cast is timed with it."""
    return f"{m}x{k}x{n}" + (f"x{batch}" if batch > 1 else "") + (
        (" fp8" if casts else " fp8 uncast") if fp8 else "")


def collect_run(run: Any) -> dict[str, Any]:
    """One run's GEMMs as its plan's tensor-parallel rank runs them, with their prices."""
    import plan_validation as pv

    from cost_model.waves import WAVE_OPS
    from passes.annotate_costs import casts_fp8_input
    from passes.fp8_linears import FP8
    from passes.meta import COST, GEMM, GEMM_DTYPE
    from smp_fx.planner.model import Profiler
    from smp_fx.planner.planner import plan
    from smp_fx.planner.profile import rank_graph, split_parts

    prep, setting = pv.prepared_for(run), pv.setting_for(run)
    prof = Profiler(prep, setting.cluster, runtime=setting.runtime,
                    fp8=setting.fp8)  # the plan's, reused
    c = plan(prep, setting, fixed=run.fix(), top_k=1, profiler=prof).best.candidate
    gm, _ = rank_graph(prof.costed(c.mbs), c.tp, c.sp, prof.device, prof.tp_comm(c.tp))
    parts = split_parts(gm, prep.repeats)
    names = PART_NAMES if prep.repeats is not None and len(parts) == 4 else tuple(
        f"part {i}" for i in range(len(parts)))
    gemms = []
    cast: set[str] = set()  # inputs an FP8 GEMM already cast
    for name, nodes in zip(names, parts, strict=True):
        if name == "first layer":
            continue  # the repeated layer stands for every layer
        for node in nodes:
            shapes, cost = GEMM.get(node), COST.get(node)
            if shapes is None or cost is None or cost.op not in WAVE_OPS:
                continue  # the rewrite's own nodes carry the linear's meta too
            g = shapes[1]
            fp8 = GEMM_DTYPE.get(node) == FP8
            casts = fp8 and casts_fp8_input(node, cast)
            gemms.append({"part": name, "node": node.name, "m": g.m, "k": g.k, "n": g.n,
                          "batch": g.batch, "flops": 2.0 * g.m * g.k * g.n * g.batch,
                          "fp8": fp8, "casts_input": casts,
                          "priced_forward_s": cost.fwd_time_s,
                          "priced_backward_s": cost.bwd_time_s})
    return {"run": run.id, "plan": c.label(), "device": prof.device.name,
            "layers": prep.repeats.count if prep.repeats else 0, "gemms": gemms}


def collect(gpu: str, rows: str) -> dict[str, Any]:
    """``collect_run`` for each run of ``gpu`` (or of ``rows``) that the planner prices."""
    import plan_validation as pv

    from cost_model.errors import SMPError

    out = []
    for run in pv.read_runs():
        if (rows and run.id not in rows.split(",")) or (gpu and run.gpu != gpu):
            continue
        try:
            out.append(collect_run(run))
        except SMPError as exc:
            print(f"{run.id}: refused ({exc}); left out", flush=True)
            continue
        print(f"{run.id}: {out[-1]['plan']}, {len(out[-1]['gemms'])} GEMMs", flush=True)
    return {"runs": out}


def shapes_of(collected: dict[str, Any], grid: bool) -> list[tuple[int, int, int, int]]:
    """The distinct (m, k, n, batch) the collected runs run in bf16, then the grid's."""
    seen: dict[tuple[int, int, int, int], None] = {}
    for run in collected["runs"]:
        for g in run["gemms"]:
            if not g.get("fp8"):
                seen[(g["m"], g["k"], g["n"], g["batch"])] = None
    if grid:
        for m in GRID_M:
            for k in GRID_KN:
                for n in GRID_KN:
                    seen[(m, k, n, 1)] = None
    return list(seen)


def fp8_shapes_of(collected: dict[str, Any]) -> list[tuple[int, int, int, bool]]:
    """The distinct (m, k, n, whether it casts its input) the collected runs run in FP8."""
    return list(dict.fromkeys((g["m"], g["k"], g["n"], g["casts_input"])
                              for run in collected["runs"] for g in run["gemms"]
                              if g.get("fp8")))


def _fp8_forms(m: int, k: int, n: int, device: torch.device, casts_input: bool = True
               ) -> dict[str, Callable[[], torch.Tensor]]:
    """The three GEMMs of an FP8 linear of this shape, as ``torch._scaled_mm`` takes them
    (its second operand column-major, hence the transposed copies), the forward with its
    input's casts (unless another linear cast that input) and the input gradient with the
    output gradient's; the weight's casts happen once a step and are left out, as the
    pricing leaves them out."""
    f8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    one = torch.ones((), device=device)
    x, g = (torch.randn(*s, dtype=bf16, device=device) for s in ((m, k), (m, n)))
    w8 = torch.randn(n, k, dtype=bf16, device=device).to(f8)
    w8t = w8.t().contiguous()
    x8t, g8t = x.t().contiguous().to(f8), g.t().contiguous().to(f8)

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=bf16)

    x8 = x.to(f8)

    def forward() -> torch.Tensor:
        if not casts_input:
            return mm(x8, w8.t())
        fresh, _ = x.to(f8), x.t().contiguous().to(f8)
        return mm(fresh, w8.t())

    def input_grad() -> torch.Tensor:
        g8, _ = g.to(f8), g.t().contiguous().to(f8)
        return mm(g8, w8t.t())

    return {"forward": forward, "input_grad": input_grad,
            "weight_grad": lambda: mm(g8t, x8t.t())}


def _forms(m: int, k: int, n: int, batch: int, dtype: torch.dtype, device: torch.device
           ) -> dict[str, Callable[[], torch.Tensor]]:
    """The three GEMMs of a linear of this shape on fresh random operands, each writing
    into its own output."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    lead = (batch,) if batch > 1 else ()
    x, w, g = rand(*lead, m, k), rand(*lead, n, k), rand(*lead, m, n)
    y, dx, dw = (torch.empty(*lead, *s, dtype=dtype, device=device)
                 for s in ((m, n), (m, k), (n, k)))
    mm = torch.bmm if batch > 1 else torch.mm
    return {"forward": lambda: mm(x, w.transpose(-1, -2), out=y),
            "input_grad": lambda: mm(g, w, out=dx),
            "weight_grad": lambda: mm(g.transpose(-1, -2), x, out=dw)}


def time_call(fn: Callable[[], Any], calls: int, repeats: int, device: torch.device
              ) -> float:
    """Seconds per call: the median over ``repeats`` of the mean of ``calls`` back-to-back
    calls (CUDA events on a GPU, the wall clock on the CPU), after two warm-up calls."""
    import time

    fn(), fn()
    means = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            means.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            means.append((time.perf_counter() - t0) / calls)
    return statistics.median(means)


def time_shapes(shapes: Iterable[tuple[int, int, int, int]], calls: int, repeats: int,
                dtype: torch.dtype, device: torch.device, fp8: bool = False
                ) -> list[dict[str, Any]]:
    """Each shape's three GEMMs timed (``time_call``), with the FLOP/s each reached; with
    ``fp8``, each (m, k, n, casts its input) as an FP8 linear runs it (``_fp8_forms``)."""
    out = []
    shapes = list(shapes)
    for i, (m, k, n, fourth) in enumerate(shapes):
        batch, casts = (1, bool(fourth)) if fp8 else (fourth, True)
        forms = (_fp8_forms(m, k, n, device, casts) if fp8
                 else _forms(m, k, n, batch, dtype, device))
        flops = 2.0 * m * k * n * batch
        row: dict[str, Any] = {"m": m, "k": k, "n": n, "batch": batch, "fp8": fp8,
                               "casts_input": casts}
        for form, fn in forms.items():
            s = time_call(fn, calls, repeats, device)
            row[f"{form}_s"], row[f"{form}_flops_per_s"] = s, flops / s
        out.append(row)
        del forms
        if (i + 1) % 50 == 0 or i + 1 == len(shapes):
            print(f"timed {i + 1} / {len(shapes)} shapes", flush=True)
    return out


def time_main(args: argparse.Namespace) -> dict[str, Any]:
    collected = json.loads(args.collected.read_text())
    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    shapes = shapes_of(collected, args.grid and not args.tiny)
    fp8 = [(m, k, n, int(c)) for m, k, n, c in fp8_shapes_of(collected)]
    if args.tiny:
        shapes, fp8 = [(64, 32, 48, 1), (32, 16, 24, 2)], [(64, 32, 48, 1), (64, 32, 16, 0)]
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    print(f"timing {len(shapes)} shapes x {len(FORMS)} GEMMs on {name} ({dtype}), "
          f"{len(fp8)} in FP8", flush=True)
    rows = time_shapes(shapes, args.calls, args.repeats, dtype, device)
    rows += time_shapes(fp8, args.calls, args.repeats, dtype, device, fp8=True)
    return {"device": name, "torch": torch.__version__,
            "cuda": torch.version.cuda, "dtype": str(dtype).split(".")[-1],
            "calls": args.calls, "repeats": args.repeats, "shapes": rows}


def compare(collected: dict[str, Any], timed: dict[str, Any]) -> list[str]:
    """Per run, its layer's and head/tail's GEMMs priced against measured (forward and
    backward, seconds a microbatch), and the worst shapes by measured / priced."""
    measured = {_key(r["m"], r["k"], r["n"], r["batch"], r.get("fp8", False),
                     r.get("casts_input", True)): r for r in timed["shapes"]}
    lines = [f"measured on {timed['device']} ({timed['dtype']}, torch {timed['torch']}, "
             f"CUDA {timed['cuda']}); priced on each run's spec",
             f"{'run':<36} {'part':<6} {'GEMMs':>5} {'priced ms':>10} {'measured ms':>11} "
             f"{'meas/priced':>11}"]
    ratios = []
    for run in collected["runs"]:
        for part in ("layer", "head", "tail"):
            gemms = [g for g in run["gemms"] if g["part"] == part]
            if not gemms:
                continue
            priced = sum(g["priced_forward_s"] + g["priced_backward_s"] for g in gemms)
            got = [measured.get(_key(g["m"], g["k"], g["n"], g["batch"], g.get("fp8", False),
                                     g.get("casts_input", True))) for g in gemms]
            if any(t is None for t in got) or priced <= 0:
                lines.append(f"{run['run']:<36} {part:<6} not timed")
                continue
            meas = sum(t["forward_s"] + t["input_grad_s"] + t["weight_grad_s"]
                       for t in got if t is not None)
            if part == "layer":
                ratios.append(meas / priced)
            lines.append(f"{run['run']:<36} {part:<6} {len(gemms):>5} {priced * 1e3:>10.3f} "
                         f"{meas * 1e3:>11.3f} {meas / priced:>11.3f}")
    if ratios:
        lines.append(f"layers: measured / priced median {statistics.median(ratios):.3f}, "
                     f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} runs")
    return lines


def efficiency_lines(timed: dict[str, Any], peak: float) -> list[str]:
    """Each timed shape's three GEMMs as a share of ``peak`` (an FP8 shape's: of twice it,
    Hopper's FP8 peak)."""
    lines = [f"{'m x k x n (x batch)':<24} " + " ".join(f"{f:>11}" for f in FORMS)]
    for r in timed["shapes"]:
        of = peak * (2.0 if r.get("fp8") else 1.0)
        cells = " ".join(f"{r[f'{f}_flops_per_s'] / of:>11.3f}" for f in FORMS)
        name = _key(r["m"], r["k"], r["n"], r["batch"], r.get("fp8", False),
                    r.get("casts_input", True))
        lines.append(f"{name:<24} {cells}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="the runs' GEMMs and their prices (CPU)")
    c.add_argument("--gpu", default="H100", help="runs on this GPU type ('' for all)")
    c.add_argument("--rows", default="", help="comma-separated run ids")
    c.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("time", help="time the collected shapes (a GPU)")
    t.add_argument("collected", type=Path)
    t.add_argument("--grid", action="store_true", help="also time the grid of shapes")
    t.add_argument("--calls", type=int, default=5)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--tiny", action="store_true", help="two small shapes on the CPU")
    t.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("compare", help="priced against measured")
    p.add_argument("collected", type=Path)
    p.add_argument("timed", type=Path)
    p.add_argument("--peak", type=float, default=989.4e12,
                   help="the dense peak the shares are of (default: GH100's bf16)")
    p.add_argument("--shapes", action="store_true", help="print every shape's shares")
    args = ap.parse_args(argv)
    if args.cmd == "collect":
        args.out.write_text(json.dumps(collect(args.gpu, args.rows), indent=1) + "\n")
    elif args.cmd == "time":
        args.out.write_text(json.dumps(time_main(args), indent=1) + "\n")
    else:
        collected, timed = (json.loads(f.read_text()) for f in (args.collected, args.timed))
        lines = compare(collected, timed)
        if args.shapes:
            lines += efficiency_lines(timed, args.peak)
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
