"""Calibrate a GPU, plan a ~1B GPT on it at pp = 1 with full recomputation, and measure it.

The GPU check of the cluster planner (docs/planning.md, "On a GPU"):

1. calibrate this device into a ``DeviceSpec``: ``cost_model.calibrate`` (the device
   figures of ``smp-fx calibrate --device cuda``), with what decides a large bf16 GPT
   measured at its sizes (``cost_model.model_sizes``): bf16 matmul efficiency by smallest
   dimension (up to 8192), the fused causal attention's rate at the model's head shape,
   element-wise bandwidth by size, and Adam's step at realistic sizes;
2. price the GPT with the planner (``smp-fx plan``'s own code: ``smp_fx.cli.plan.main``,
   ``--device`` the spec, ``--gpus 1``, ``--fix tp=1,pp=1,dp=1,recompute=full``, bf16);
3. train the same configuration through smp-fx (``smp.init`` with the emitted
   configuration, ``smp.set_activation_checkpointing`` on each block, the step function
   under ``torch.autocast(device, torch.bfloat16)``: bf16 as the planner prices it, autocast
   over fp32 weights, docs/planning.md), Adam; the median of the timed steps after warm-up
   (synchronized) and ``torch.cuda.max_memory_allocated`` (the busiest GPU's) beside the
   prediction.

    PYTHONPATH=. python3 benchmarks/plan_gpu.py --out plan_gpu.json          # a GPU
    .venv/bin/python benchmarks/plan_gpu.py --tiny --out /tmp/plan_gpu.json  # CPU, seconds

On the CPU (``--tiny``) the quick cpu spec prices the plan and bf16 autocast runs on the
CPU, which the spec does not price: that run checks the script, not the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
T0 = time.perf_counter()
GiB = 1024**3


def say(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {message}", flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="4 layers x 64 on the CPU, seconds")
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--fix", default="tp=1,pp=1,dp=1,recompute=full")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (the median)")
    ap.add_argument("--out", type=Path, help="write the figures here (JSON)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.n_layer, args.n_embd, args.n_head, args.vocab_size, args.seq_len = 4, 64, 4, 128, 32
        args.global_batch, args.warmup, args.steps = 4, 1, 3
    return args


# ------------------------------------------------------------------------- calibration
def calibrate(args: argparse.Namespace, device: torch.device) -> Any:
    """``smp-fx calibrate``'s device figures; on an accelerator measured again at the GPT's
    sizes (``cost_model.model_sizes``)."""
    from cost_model import calibrate as measure
    from cost_model.model_sizes import ModelSizes

    if device.type == "cpu":
        say("calibrating: the quick cpu spec (cost_model.calibrate.quick_cpu_spec)")
        return measure.quick_cpu_spec()
    name = torch.get_device_module(device).get_device_name(device).replace(" ", "-").lower()
    sizes = ModelSizes(heads=args.n_head, seq=args.seq_len, head_dim=args.n_embd // args.n_head)
    say(f"calibrating {name} at the GPT's sizes: cost_model.calibrate with {sizes}")
    spec = measure.calibrate(f"calibrated-{name}", device, sizes=sizes)
    for key, value in measure.figures(spec):
        say(f"  {key}: {value}")
    return spec


# ---------------------------------------------------------------------------- planning
def plan(args: argparse.Namespace, spec_file: Path, work: Path) -> tuple[dict[str, Any],
                                                                          dict[str, Any]]:
    from smp_fx.cli import plan as plan_cli

    sizes = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head,
             "vocab_size": args.vocab_size, "seq_len": args.seq_len}
    argv = [str(ROOT / "examples/models/gpt.py"), "--meta"]
    argv += [x for k, v in sizes.items() for x in ("--build-arg", f"{k}={v}")]
    argv += ["--inputs-arg", f"seq_len={args.seq_len}", "--inputs-arg",
             f"vocab_size={args.vocab_size}", "--device", str(spec_file), "--gpus", "1",
             "--global-batch", str(args.global_batch), "--fix", args.fix, "--top", "3",
             "--json", str(work / "plan.json"), "--emit-config", str(work / "cfg.json")]
    say("$ smp-fx plan " + " ".join(argv))
    if plan_cli.main(argv) != 0:
        raise SystemExit("smp-fx plan failed (its error is above)")
    return (json.loads((work / "plan.json").read_text())["best"],
            json.loads((work / "cfg.json").read_text()))


# ----------------------------------------------------------------------------- measuring
def busy_share(step: Any, sync: Any, trace: Path | None = None) -> dict[str, Any]:
    """One more ``step()`` under ``torch.profiler``: its wall time, the time the GPU spent
    in kernels (their device time summed) and the ops that took the most host time. Why:
    a step whose GPU idles is bound by the host's dispatch, which the planner prices as
    hidden on a GPU (``cost_model.gpu_specs``: ``op_overheads`` zero). ``trace``: the step's
    Chrome trace is written there, gzipped. The kernels are all the device's; the host's
    ops are those of the threads the profiler follows (a step whose microbatches run in the
    executor's pool threads shows fewer aten calls than it makes)."""
    import gzip

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t0
    if trace is not None:
        raw = trace.with_suffix("")
        prof.export_chrome_trace(str(raw))
        trace.write_bytes(gzip.compress(raw.read_bytes()))
        raw.unlink()
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events  # kernels, not the ops' sums
                  if e.device_type != DeviceType.CPU and not e.is_user_annotation) / 1e6
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    top = events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48)
    return {"wall_s": wall, "gpu_kernels_s": kernels, "aten_calls": calls, "top": top}


def gpt(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The GPT of ``args`` on ``device``, seed 0."""
    from models.gpt import build_model

    torch.manual_seed(0)
    with device:
        return build_model(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                           vocab_size=args.vocab_size, seq_len=args.seq_len)


def batch(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The one global batch every step trains on: (token ids, next-token targets)."""
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, args.vocab_size, (args.global_batch, args.seq_len + 1), generator=g)
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def smp_step(args: argparse.Namespace, best: dict[str, Any], cfg: dict[str, Any],
             device: torch.device, untied: bool = False) -> tuple[Callable[[], Any], Any]:
    """(one training step of ``cfg`` through smp-fx, the ``DistributedModel``): the GPT,
    each block checkpointed when ``best`` recomputes, Adam, the step function under bf16
    autocast. ``untied``: the LM head gets its own copy of the embedding, so the in-process
    pipeline may put its stages on several GPUs (a parameter two stages share keeps them
    on one)."""
    import smp_fx as smp

    smp.init(cfg)
    net = gpt(args, device)
    if untied:
        net.lm_head.weight = torch.nn.Parameter(net.wte.weight.detach().clone())
    if best["recompute"] == "full":
        for block in net.h:
            smp.set_activation_checkpointing(block)
    inner = torch.optim.Adam(net.parameters(), lr=1e-4)
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(inner)

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, torch.bfloat16):  # the planner's bf16
            logits = model(ids)  # on the last stage's device
            loss = F.cross_entropy(logits.flatten(0, 1), target.to(logits.device).flatten())
        model.backward(loss)
        return loss

    ids, target = batch(args, device)

    def step() -> Any:
        optimizer.zero_grad()
        out = train_step(model, ids, target)
        optimizer.step()
        return out

    return step, model


def measure(args: argparse.Namespace, best: dict[str, Any], cfg: dict[str, Any],
            device: torch.device, untied: bool = False, profiled: bool = False,
            trace: Path | None = None) -> dict[str, Any]:
    """Train ``cfg`` (``smp_step``) and time it; ``profiled``: one more step under the
    profiler (``busy_share``, its trace written to ``trace``)."""
    step, model = smp_step(args, best, cfg, device, untied)
    gpus = range(torch.cuda.device_count() if device.type == "cuda" else 0)

    def sync() -> None:  # every GPU: the stages may be on several
        for d in gpus:
            torch.cuda.synchronize(d)

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and device.type == "cuda":
            for d in gpus:
                torch.cuda.reset_peak_memory_stats(d)
        sync()
        t0 = time.perf_counter()
        out = step()
        sync()
        took = time.perf_counter() - t0
        losses.append(float(out.reduce_mean().item()))
        if i >= args.warmup:
            times.append(took)
        say(f"  step {i}{' (warm-up)' if i < args.warmup else ''}: {took * 1e3:.1f} ms, "
            f"loss {losses[-1]:.3f}")
    peak = max((int(torch.cuda.max_memory_allocated(d)) for d in gpus), default=None)
    streams = getattr(model.executor.transport, "streams", None)  # in-process only
    return {"step_time_s": statistics.median(times), "step_times_s": times,
            "peak_memory_bytes": peak, "losses": losses,
            "profile": busy_share(step, sync, trace) if profiled else None,
            "devices": sorted({str(p.device) for _, p in model.local_named_parameters()}),
            "transfer_copies": None if streams is None else streams.copies}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    say(f"device {device}: torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
    work = Path(tempfile.mkdtemp(prefix="plan_gpu_"))
    spec = calibrate(args, device)
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec.to_json(), indent=1, sort_keys=True))
    say(f"calibrated; spec in {spec_file}")
    best, cfg = plan(args, spec_file, work)
    mem = best["details"]["memory"]
    say(f"predicted: step {best['step_time_s'] * 1e3:.1f} ms, memory "
        f"{best['memory_bytes_per_gpu'] / GiB:.2f} GiB (mbs {best['mbs']} x "
        f"{best['microbatches']} microbatches, recompute {best['recompute']}); "
        f"configuration {cfg}")
    got = measure(args, best, cfg, device)
    figures: dict[str, Any] = {
        "device": str(spec.name), "model": {k: getattr(args, k) for k in (
            "n_layer", "n_embd", "n_head", "vocab_size", "seq_len", "global_batch")},
        "fix": args.fix, "plan": {k: best[k] for k in ("tp", "pp", "dp", "mbs", "microbatches",
                                                         "recompute", "step_time_s",
                                                         "memory_bytes_per_gpu", "mfu")},
        "predicted_memory": mem, "measured": got, "spec": spec.to_json()}
    step_ratio = got["step_time_s"] / best["step_time_s"]
    figures["step_ratio"] = step_ratio
    print(f"step time:  predicted {best['step_time_s'] * 1e3:9.1f} ms   measured "
          f"{got['step_time_s'] * 1e3:9.1f} ms (median of {args.steps})   measured/predicted "
          f"{step_ratio:.3f}  (target within 10 %: {abs(step_ratio - 1) <= 0.10})", flush=True)
    if got["peak_memory_bytes"] is not None:
        mem_ratio = got["peak_memory_bytes"] / best["memory_bytes_per_gpu"]
        figures["memory_ratio"] = mem_ratio
        print(f"peak memory: predicted {best['memory_bytes_per_gpu'] / GiB:8.2f} GiB   "
              f"measured {got['peak_memory_bytes'] / GiB:8.2f} GiB (max_memory_allocated)   "
              f"measured/predicted {mem_ratio:.3f}  (target within 5 %: "
              f"{abs(mem_ratio - 1) <= 0.05})", flush=True)
        print("  predicted: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in mem.items())
              + " GiB", flush=True)
    else:
        print("peak memory: not measured on the CPU (torch.cuda.max_memory_allocated only)",
              flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
        say(f"wrote {args.out}")
    return figures


if __name__ == "__main__":
    main()
