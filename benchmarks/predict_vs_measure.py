"""Predicted against measured: the plan's step time and memory beside a real run.

One run, side by side: ``smp-fx calibrate --nproc 2`` measures this machine into a spec
file; then for every example model x pipeline degree {1, 2} x schedule {simple,
interleaved} the plan made with that spec (what ``smp-fx partition --device spec.json``
prints) is set beside the training step measured with ``smp-fx run -n <pp>`` on the same
model, batch and configuration (``SMP_FX_DEVICE_SPEC`` = the spec, so the runtime plans
the same stages; one intra-op thread per process, as calibrated). A training step is
``zero_grad``, the ``smp.step`` function (forward, loss, backward of every microbatch)
and ``optimizer.step()`` (Adam), timed back to back on rank 0; the median is reported.

Memory: each stage's predicted activation bytes per microbatch beside the bytes autograd
really saves on that stage (saved-tensor hooks around the staged graph run on real
tensors), and the predicted stage total (parameters, gradients, Adam state, buffers,
activations x microbatches in flight).

    python benchmarks/predict_vs_measure.py                # all, about 5 minutes
    python benchmarks/predict_vs_measure.py --models mlp gpt --steps 10
    python benchmarks/predict_vs_measure.py --degrees 1             # one GPU
    python benchmarks/predict_vs_measure.py --degrees 1 --spec h100 # the built-in spec
    python benchmarks/predict_vs_measure.py --rounds 3 --steps 20   # about 13 minutes

``--rounds N`` repeats the whole comparison (a fresh calibration, fresh measurements) and
reports each configuration's median ratio too: on the 2-core development VM the host's
speed moves by 10-25 % between minutes, so three calibrations in a row predicted one model
up to 23 % apart and one round is one draw of that noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (build_model keyword arguments, global batch); microbatches 4 for all
MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "mlp": ({"hidden": 256, "num_blocks": 8}, 64),
    "cnn": ({"width": 16}, 32),
    "gpt": ({"n_layer": 4, "n_embd": 128, "n_head": 4}, 16),
    "hf_gpt2": ({"n_layer": 4, "n_embd": 128, "n_head": 4}, 16),
    "hf_bert": ({"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4}, 16),
}
MICROBATCHES = 4
SCHEDULES = ("simple", "interleaved")


def _example(name: str) -> Any:
    from smp_fx.cli.partition import load_model_file

    return load_model_file(str(ROOT / "examples" / "models" / f"{name}.py"))


def _config(pp: int, pipeline: str) -> dict[str, Any]:
    return {"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES,
            "pipeline": pipeline}


# ------------------------------------------------------------------------- the worker


def worker(args: argparse.Namespace) -> None:
    """Runs under ``smp-fx run``: for each schedule, train and time every step; rank 0
    prints one JSON line per schedule, with every rank's CPU time per step."""
    import torch.distributed as dist

    import smp_fx as smp
    from smp_fx.world import launch, state

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # one default group; each smp.init below adds (and _reset removes) its own
        dist.init_process_group(launch.choose_backend())
    for pipeline in args.pipelines.split(","):
        smp.init(_config(world, pipeline))
        try:
            result = _train(args)
            cpu = smp.allgather(result.pop("cpu_s"), smp.WORLD) if world > 1 else [
                result.pop("cpu_s")]
            if smp.rank() == 0:
                print("RESULT " + json.dumps({"pipeline": pipeline, "cpu_s": cpu, **result}),
                      flush=True)
        finally:
            state._reset()


def _train(args: argparse.Namespace) -> dict[str, Any]:
    import smp_fx as smp

    ex = _example(args.model)
    build, batch = MODELS[args.model]
    torch.manual_seed(0)
    model = ex.build_model(**build)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(optimizer)
    device = torch.device("cuda", smp.local_rank()) if torch.cuda.is_available() else \
        torch.device("cpu")  # where an SMP script puts its batches
    inputs = tuple(x.to(device) for x in ex.example_inputs(batch))
    target = ex.example_targets(batch).to(device)

    @smp.step
    def train_step(model: Any, *args: torch.Tensor) -> Any:
        *xs, y = args
        loss = ex.loss_fn(model(*xs), y)
        model.backward(loss)
        return loss

    wall, cpu = [], []
    smp.barrier()
    for i in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        optimizer.zero_grad()
        train_step(model, *inputs, target)
        optimizer.step()
        if torch.cuda.is_available():  # the step's kernels are done, not only queued
            torch.cuda.synchronize()
        if i >= args.warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    quartiles = statistics.quantiles(wall, n=4)
    return {"median_s": statistics.median(wall), "q1_s": quartiles[0], "q3_s": quartiles[2],
            "cpu_s": statistics.median(cpu),
            "stages": [list(s.nodes) for s in model.plan.stages]}


# --------------------------------------------------------------------- the prediction


def saved_bytes_by_stage(gm: torch.fx.GraphModule, args: tuple[Any, ...],
                         stages: int) -> list[int]:
    """Bytes autograd saves on each stage for one microbatch, counted by saved-tensor hooks
    while the staged graph runs on real tensors (a storage counts once per stage)."""
    from passes import meta

    seen: list[set[int]] = [set() for _ in range(stages)]
    total = [0] * stages
    params = {p.untyped_storage().data_ptr() for p in gm.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in gm.buffers()}
    current = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        s = current[0]
        if key not in params and key not in seen[s]:
            seen[s].add(key)
            total[s] += t.untyped_storage().nbytes()
        return t

    class Run(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            stage = meta.STAGE.get(n)
            current[0] = stage if stage is not None else current[0]
            return super().run_node(n)

    # a microbatch is a slice of the batch: its own copy, so its storage is its own size
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        Run(gm).run(*args)
    return total


def predict(name: str, spec_path: str, degrees: tuple[int, ...] = (1, 2)
            ) -> dict[tuple[int, str], dict[str, Any]]:
    """Plans for every (pp, schedule) of one model, as ``smp-fx partition`` makes them."""
    from cost_model.devices import load_device
    from passes.partition_config import PartitionConfig
    from passes.pipeline import analyse, partition
    from passes.trace import trace
    from smp_fx.runtime.inputs.microbatch import split_inputs

    ex = _example(name)
    build, batch = MODELS[name]
    spec = load_device(spec_path)
    torch.manual_seed(0)
    model = ex.build_model(**build)
    mb = split_inputs(tuple(ex.example_inputs(batch)), {}, MICROBATCHES)[0][0]
    traced = trace(model, mb, {})
    out = {}
    for pp in degrees:
        priced = spec.for_stages(pp)  # as smp-fx partition and DistributedModel price it
        costed = analyse(model, mb, device=priced, traced=traced)
        for pipeline in SCHEDULES:
            cfg = PartitionConfig(num_stages=pp, microbatches=MICROBATCHES, pipeline=pipeline,
                                  device=spec.name, memory_weight=0.8)
            compiled = partition(costed, cfg, device=priced)
            saved = saved_bytes_by_stage(compiled.gm, mb, pp)
            out[(pp, pipeline)] = {"plan": compiled.plan, "saved": saved}
    return out


# ------------------------------------------------------------------------ the driver


def measure(name: str, pp: int, spec_path: str, steps: int, warmup: int
            ) -> dict[str, dict[str, Any]]:
    """Both schedules of one model at pipeline degree ``pp``, in one ``smp-fx run``."""
    env = {**os.environ, "SMP_FX_DEVICE_SPEC": spec_path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "smp_fx.cli.main", "run", "-n", str(pp), __file__,
           "--worker", "--model", name, "--pipelines", ",".join(SCHEDULES),
           "--steps", str(steps), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                          timeout=900)
    results = [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines()
               if ln.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != len(SCHEDULES):
        raise RuntimeError(f"{name} pp={pp} failed:\n{proc.stderr[-3000:]}")
    return {r["pipeline"]: r for r in results}


def calibrate(path: str, quick: bool, nproc: int) -> None:
    cmd = [sys.executable, "-m", "smp_fx.cli.main", "calibrate", "--nproc", str(nproc),
           "-o", path]
    cmd += ["--quick"] if quick else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"smp-fx calibrate failed:\n{proc.stderr[-3000:]}")
    print(f"smp-fx calibrate --nproc {nproc}: {time.perf_counter() - t0:.1f} s")
    print("\n".join("  " + ln for ln in proc.stdout.splitlines() if not ln.startswith("wrote")))


def _busy_s(plan: Any) -> float:
    """Predicted busy time per step summed over the ranks: their actions, optimizer steps
    and the runtime's fixed step cost (waiting excluded)."""
    sim = plan.simulate()
    spec = plan.spec()
    return sum(b + st.optimizer_time_s + spec.step_overhead_s
               for b, st in zip(sim.busy_s, plan.stages))


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _round(args: argparse.Namespace, rnd: int, spec_path: str, saved_runs: dict[str, Any]
           ) -> list[tuple[Any, ...]]:
    """One calibration (unless ``--spec``), then every configuration predicted and measured
    (or taken from ``saved_runs``, where the measurements are kept); the rows printed."""
    if not args.spec:
        calibrate(spec_path, args.quick_calibration, max(args.degrees))
    rows = []
    print(f"\n{'model':8s} {'pp':>2s} {'schedule':11s} {'predicted':>10s} "
          f"{'measured':>10s} {'(q1-q3)':>17s} {'ratio':>6s} {'cpu':>6s}  same plan")
    for name in args.models:
        predicted = predict(name, spec_path, tuple(args.degrees))
        for pp in args.degrees:
            key = f"{name}/{pp}" + (f"#{rnd}" if rnd else "")
            if key not in saved_runs:
                saved_runs[key] = measure(name, pp, spec_path, args.steps, args.warmup)
            measured = saved_runs[key]
            for pipeline in SCHEDULES:
                plan, got = predicted[(pp, pipeline)]["plan"], measured[pipeline]
                same = got["stages"] == [list(s.nodes) for s in plan.stages]
                ratio = plan.step_time_s / got["median_s"]
                cpu = _busy_s(plan) / sum(got["cpu_s"])
                rows.append((name, pp, pipeline, plan, predicted[(pp, pipeline)]["saved"],
                             got, cpu, ratio))
                print(f"{name:8s} {pp:2d} {pipeline:11s} {plan.step_time_s * 1e3:8.2f}ms "
                      f"{got['median_s'] * 1e3:8.2f}ms ({got['q1_s'] * 1e3:7.2f}-"
                      f"{got['q3_s'] * 1e3:7.2f}) {ratio:6.3f} {cpu:6.3f}  "
                      f"{'yes' if same else 'NO'}", flush=True)
    _summary("predicted / measured step time", [r[-1] for r in rows])
    _summary("cpu: predicted busy time of all ranks / their measured CPU time per step "
             "(what the work costs, whatever else runs)", [r[-2] for r in rows], targets=False)
    return rows


def _summary(what: str, ratios: list[float], targets: bool = True) -> None:
    errors = [abs(r - 1.0) for r in ratios]
    print(f"{what} over {len(ratios)} configurations: median |ratio - 1| = "
          f"{statistics.median(errors):.3f}, worst = {max(errors):.3f}"
          + (" (targets 0.10, 0.20)" if targets else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--spec", help="use this spec (a file, or a built-in name such as h100) "
                                   "instead of calibrating")
    ap.add_argument("--degrees", type=int, nargs="*", default=[1, 2], choices=[1, 2],
                    help="pipeline degrees (one GPU: 1 only, a rank per GPU)")
    ap.add_argument("--quick-calibration", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="calibrate and measure this many times; with more than one, the "
                         "median of each configuration's ratios is reported too")
    ap.add_argument("--save-measured", metavar="FILE",
                    help="write the measured step times to FILE (JSON)")
    ap.add_argument("--measured", metavar="FILE",
                    help="reuse step times measured before (--save-measured) instead of "
                         "running: re-predicts only, e.g. after changing the cost model")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--pipelines", default=",".join(SCHEDULES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    saved_runs: dict[str, Any] = json.loads(Path(args.measured).read_text()) \
        if args.measured else {}
    by_round = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"\n=== round {rnd + 1} of {args.rounds}")
            by_round.append(_round(args, rnd, args.spec or str(Path(tmp) / "spec.json"),
                                   saved_runs))
    if args.save_measured:
        Path(args.save_measured).write_text(json.dumps(saved_runs, indent=1))
    rows = by_round[0]
    if args.rounds > 1:
        print(f"\nmedian over the {args.rounds} rounds (a fresh calibration and fresh "
              "measurements each) of every configuration's predicted / measured ratio:")
        medians = []
        for i, (name, pp, pipeline, *_) in enumerate(rows):
            ratios = [r[i][-1] for r in by_round]
            medians.append(statistics.median(ratios))
            print(f"{name:8s} {pp:2d} {pipeline:11s} {medians[-1]:6.3f}  ("
                  + " ".join(f"{x:.3f}" for x in ratios) + ")")
        _summary("medians over rounds", medians)
    print("\nmemory per stage: predicted activations per microbatch / bytes autograd saved "
          "(KiB, ratio); predicted stage total (MiB: parameters, gradients, Adam state, "
          "buffers, activations x microbatches in flight)")
    print(f"{'model':8s} {'pp':>2s} {'schedule':11s} stages")
    for name, pp, pipeline, plan, saved, *_ in rows:
        cells = [f"{st.memory.activations_per_microbatch / 1024:.1f} / {sv / 1024:.1f} "
                 f"({st.memory.activations_per_microbatch / max(sv, 1):.3f}); "
                 f"{_mib(st.memory.total)}" for st, sv in zip(plan.stages, saved)]
        print(f"{name:8s} {pp:2d} {pipeline:11s} " + " | ".join(cells))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
