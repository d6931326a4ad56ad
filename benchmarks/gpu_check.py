"""The device check in one table: CUDA tests, the 1.3B GPT eager and compiled, pp 2 in-process.

Where a GPU is lent, one run shows what only a GPU can show:

1. the CUDA tests (``SMP_FX_TEST_GPU=1 pytest tests/smp_fx/test_cuda.py``): passed,
   skipped, failed;
2. the 1.3B GPT (``examples/models/gpt.py``, 24 x 2048) at pp 1, full recompute, bf16
   autocast, Adam, as ``benchmarks/plan_gpu.py`` runs it: the device calibrated at the
   model's sizes (``cost_model.model_sizes``), the configuration priced by ``smp-fx plan``,
   then trained eager and with ``compile: inductor``: step, MFU and peak memory, predicted
   beside measured (MFU measured: the plan's model FLOPs over the measured step; the
   planner prices no compilation, so the compiled row's prediction is the eager one);
3. the same model at pp 2 with both stages in this process on one device (1F1B,
   ``--pp2-microbatches``): the in-process pipeline's step and peak memory, and beside it
   pp 1 with the same microbatches (what the microbatching costs without the pipeline);
4. where two or more GPUs are present, pp 2 across ``cuda:0`` and ``cuda:1`` (the LM head
   untied, so the stages may sit on two devices) with the copies between the stages on
   their transfer streams and, as the baseline, on the current stream
   (``SMP_FX_TRANSFER_STREAM=0``): a step each. On one GPU the table says why this is not run.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json      # a GPU
    .venv/bin/python benchmarks/gpu_check.py --tiny                             # CPU, seconds

``--tiny`` runs every part on the CPU with a 4-layer GPT, two timed steps each, the
compiled row through ``aot_eager`` (the CUDA tests then skip): it checks the script, not
the figures. ``--profile``: each run takes one more step under the profiler and a second
table says how much of it the GPU spent in kernels (``plan_gpu.busy_share``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import plan_gpu  # noqa: E402  (the calibrate / plan / train steps this check repeats)

GiB = 1024**3


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 4-layer GPT on the CPU, seconds")
    ap.add_argument("--compile-backend", choices=("inductor", "aot_eager"),
                    help="the compiled row's backend (default: inductor; aot_eager with "
                         "--tiny, whose CPU would spend minutes in inductor's codegen)")
    ap.add_argument("--pp2-microbatches", type=int, default=4)
    ap.add_argument("--skip-tests", action="store_true", help="leave out the CUDA tests")
    ap.add_argument("--profile", action="store_true",
                    help="one more step of each run under the profiler: the GPU's busy share")
    ap.add_argument("--traces", type=Path,
                    help="with --profile: write each profiled step's trace here (gzipped)")
    ap.add_argument("--tests-timeout", type=float, default=480.0)
    ap.add_argument("--out", type=Path, help="write the figures here (JSON)")
    args = ap.parse_args(argv)
    args.compile_backend = args.compile_backend or ("aot_eager" if args.tiny else "inductor")
    return args


def cuda_tests(timeout: float) -> dict[str, Any]:
    """``tests/smp_fx/test_cuda.py`` with the GPUs shown: its summary line's counts."""
    env = {**os.environ, "SMP_FX_TEST_GPU": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/smp_fx/test_cuda.py"]
    plan_gpu.say("$ SMP_FX_TEST_GPU=1 " + " ".join(cmd[1:]))
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|error)",
                                                run.stdout.splitlines()[-1] if run.stdout
                                                else "")}
    if run.returncode not in (0, 5):
        print(run.stdout[-4000:] + run.stderr[-2000:], flush=True)
    return {"returncode": run.returncode, **counts}


def train(pargs: argparse.Namespace, best: dict[str, Any], cfg: dict[str, Any],
          device: torch.device, untied: bool = False, **changes: Any) -> dict[str, Any]:
    """``plan_gpu.measure`` on a fresh ``smp.init`` of ``cfg`` with ``changes`` (profiled
    when ``pargs.profile``)."""
    from smp_fx.world import state

    state._reset()
    gc.collect()  # the previous run's model and optimizer, before the peak is reset
    if device.type != "cpu":
        torch.get_device_module(device).empty_cache()
    trace = None
    if pargs.profile and pargs.traces is not None:
        pargs.traces.mkdir(parents=True, exist_ok=True)
        trace = pargs.traces / f"trace_{len(list(pargs.traces.iterdir()))}.json.gz"
    return plan_gpu.measure(pargs, best, {**cfg, **changes}, device, untied=untied,
                            profiled=pargs.profile, trace=trace)


@contextlib.contextmanager
def transfer_streams(on: bool) -> Iterator[None]:
    """``SMP_FX_TRANSFER_STREAM`` set for the runs inside (their transports read it)."""
    from smp_fx.runtime.transport.transfer_stream import ENV

    saved = os.environ.get(ENV)
    os.environ[ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = saved


def two_devices(pargs: argparse.Namespace, best: dict[str, Any], cfg: dict[str, Any],
                device: torch.device, pp2: dict[str, Any]) -> list[dict[str, Any]]:
    """pp 2 on ``cuda:0`` and ``cuda:1``, the copies on the transfer streams, then on the
    current stream: one row each, naming the devices the stages took and the copies made
    on transfer streams (so a run that did not take the path says so)."""
    rows = []
    for on, how in ((True, "transfer streams"), (False, "current stream")):
        with transfer_streams(on):
            got = train(pargs, best, cfg, device, untied=True, **pp2)
        name = (f"GPT pp 2 in one process on {' and '.join(got['devices'])}, copies on the "
                f"{how} ({got['transfer_copies']} on transfer streams)")
        rows.append({**row(name, best, got, False), "transfer_copies": got["transfer_copies"]})
    return rows


def one_device_note(gpus: int) -> str:
    """Why the transfer-stream rows are not run here."""
    return (f"not run: the transfer streams need two devices, GPUs here: {gpus} (the stages "
            "of one device hand values over by reference: nothing to copy)")


def row(name: str, best: dict[str, Any], got: dict[str, Any], predicted: bool) -> dict[str, Any]:
    """One table row: measured beside the plan's prediction (``predicted`` False: the plan
    prices another configuration, so only the measured figures are shown)."""
    mfu = best["mfu"] * best["step_time_s"] / got["step_time_s"]
    return {"check": name, "measured_step_s": got["step_time_s"], "measured_mfu": mfu,
            "peak_memory_bytes": got["peak_memory_bytes"], "losses": got["losses"],
            "predicted_step_s": best["step_time_s"] if predicted else None,
            "predicted_mfu": best["mfu"] if predicted else None,
            "predicted_memory_bytes": best["memory_bytes_per_gpu"] if predicted else None,
            "profile": got.get("profile")}


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value * 1e3:.1f} ms"
    if unit == "GiB":
        return f"{value / GiB:.2f} GiB"
    return f"{value:.1%}"


def table(rows: list[dict[str, Any]], tests: dict[str, Any] | None,
          notes: dict[str, str]) -> str:
    """The figures, one row per run; ``notes`` (check -> text): rows with no figures."""
    head = ("check", "predicted step", "measured step", "ratio", "MFU pred / meas",
            "predicted memory", "peak memory")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    if tests is not None:
        counts = ", ".join(f"{v} {k}" for k, v in tests.items() if k != "returncode")
        notes = {"CUDA tests (tests/smp_fx/test_cuda.py)":
                 f"{counts or 'no summary'} (exit {tests['returncode']})", **notes}
    lines += [f"| {check} | {text} | | | | | |" for check, text in notes.items()]
    for r in rows:
        ratio = (f"{r['measured_step_s'] / r['predicted_step_s']:.3f}"
                 if r["predicted_step_s"] else "-")
        mfu = f"{_cell(r['predicted_mfu'], '%')} / {_cell(r['measured_mfu'], '%')}"
        lines.append(f"| {r['check']} | {_cell(r['predicted_step_s'], 'ms')} | "
                     f"{_cell(r['measured_step_s'], 'ms')} | {ratio} | {mfu} | "
                     f"{_cell(r['predicted_memory_bytes'], 'GiB')} | "
                     f"{_cell(r['peak_memory_bytes'], 'GiB')} |")
    return "\n".join(lines)


def busy_table(rows: list[dict[str, Any]]) -> str:
    """The profiled step of each run: wall time, the GPU's time in kernels, aten calls."""
    lines = ["| check | profiled step | GPU in kernels | share | aten calls |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        p = r.get("profile")
        if p:
            lines.append(f"| {r['check']} | {p['wall_s'] * 1e3:.1f} ms | "
                         f"{p['gpu_kernels_s'] * 1e3:.1f} ms | "
                         f"{p['gpu_kernels_s'] / p['wall_s']:.1%} | {p['aten_calls']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    pargs = plan_gpu.parse(["--tiny"] if args.tiny else [])
    pargs.profile, pargs.traces = args.profile, args.traces
    if args.tiny:  # one thread: a shared CPU's second thread only waits on the first
        pargs.steps = 2
        torch.set_num_threads(1)
    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    tests = None if args.skip_tests else cuda_tests(args.tests_timeout)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    spec = plan_gpu.calibrate(pargs, device)
    spec_file = work / "spec.json"
    spec_file.write_text(json.dumps(spec.to_json(), indent=1, sort_keys=True))
    best, cfg = plan_gpu.plan(pargs, spec_file, work)
    rows = [row("GPT pp 1, eager", best, train(pargs, best, cfg, device), True),
            row(f"GPT pp 1, compile: {args.compile_backend}", best,
                train(pargs, best, cfg, device, compile=args.compile_backend), True)]
    pp2 = {"pipeline_parallel_degree": 2, "microbatches": args.pp2_microbatches,
           "pipeline": "interleaved"}
    rows.append(row(f"GPT pp 2 in one process, {args.pp2_microbatches} microbatches", best,
                    train(pargs, best, cfg, device, **pp2), False))
    rows.append(row(f"GPT pp 1, {args.pp2_microbatches} microbatches", best,
                    train(pargs, best, cfg, device, microbatches=args.pp2_microbatches),
                    False))
    gpus = torch.cuda.device_count() if gpu else 0
    notes = {}
    if gpus >= 2:
        rows += two_devices(pargs, best, cfg, device, pp2)
    else:
        notes["GPT pp 2 on cuda:0 and cuda:1, transfer streams vs current stream"] = \
            one_device_note(gpus)
    text = table(rows, tests, notes)
    if args.profile:
        text += "\n\n" + busy_table(rows)
        for r in rows:
            print(f"{r['check']}: the ops of most host time\n{r['profile']['top']}", flush=True)
    print(text, flush=True)
    figures = {"device": spec.name, "torch": torch.__version__, "tiny": args.tiny,
               "model": {k: getattr(pargs, k) for k in ("n_layer", "n_embd", "n_head",
                                                         "vocab_size", "seq_len",
                                                         "global_batch")},
               "configuration": cfg, "cuda_tests": tests, "rows": rows, "notes": notes,
               "table": text}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
        plan_gpu.say(f"wrote {args.out}")
    return figures


if __name__ == "__main__":
    main()
